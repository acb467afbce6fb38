"""The pilot-commit part of the allocator (allocation.py; rollout.pilot, docs/allocation.md):
a round of pilots, each pilot's verdict (passed, deferred, evicted), the commits of the first
passers in slot order, the surplus passers into the prompt reserve, and the fill rounds that
follow while the step has fewer than B commits and budget left. Torch-free and deterministic.

A verdict (exact on counts, config/allocation.py `Thresholds`), with s successes of n_pilot:
passed iff pass_lower <= s / n_pilot <= pass_upper; evicted iff s / n_pilot >= evict_at (at once,
or from the loader's next epoch on: `evict_from`); a prompt that did not pass is deferred to the
next epoch. A prompt may pass and be evicted (a band reaching evict_at): it trains this step and is
not drawn again after. Fill rounds (`fill_from`) take passers kept from earlier steps (the prompt
reserve, each admitted only while a full K still fits), then fresh prompts from the loader
(as many as num_candidates, and as leave room for at least one commit).

`PilotCommit` is a mixin of `Allocator`, not a class of its own: it works on the allocator's
run state (`pilot`, `batch_size`, the evicted and deferred maps, the prompt reserve `replay`, the
latest loader `_epoch`, the `_thresholds`) and its request book-keeping (`_draw`, `_request`,
`_new_slot`), always under the allocator's lock.
"""
from __future__ import annotations

import math

from .alloc_types import (COMMIT, COMMITTED, DEFERRED, PASSED, PENDING, PILOT, SOLVED, SURPLUS, AllocRequest,
                          Candidate, Outcome, Round, SlotState, StepState)


class PilotCommit:
    """Pilot rounds, verdicts, commits and fill rounds (see the module docstring)."""

    def _start_round(self, st: StepState, slots: list[int]) -> list[AllocRequest]:
        requests = [self._request(st, slot, PILOT) for slot in slots]
        n_commit = st.group_size - st.n_pilot
        room = min(self.batch_size - st.committed, (st.budget - st.spent) // n_commit)
        st.rounds.append(Round(slots, max(room, 0)))
        st.counts["pilot/piloted"] += len(slots)
        st.counts["pilot/rounds"] += 1
        return requests

    def _on_pilot(self, st: StepState, s: SlotState, rewards: tuple[float, ...]) -> None:
        successes = sum(1 for r in rewards if r >= self.pilot.success_threshold)
        mean = sum(rewards) / len(rewards)
        s.pilot_std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        passed = self._thresholds.passes(successes, len(rewards))
        evicted = self._thresholds.evicts(successes, len(rewards))
        if evicted:
            st.counts["pilot/solved_dropped"] += 1
            self._solved[s.key] = max(s.epoch, self._solved.get(s.key, s.epoch))
            self.replay.discard(s.key)
            if self.pilot.evict_from == "now":
                self._deferred.pop(s.key, None)
                if not passed:
                    s.status = SOLVED
                    return
        if passed:
            s.status = PASSED
            return
        s.status = DEFERRED
        if not evicted:
            st.counts["pilot/deferred"] += 1
        # evicted from the next epoch on: deferred for the rest of this one, like any prompt that failed
        if self.pilot.evict_from == "next_epoch" or s.key not in self._solved:
            self._deferred[s.key] = max(s.epoch, self._deferred.get(s.key, s.epoch))
        self.replay.discard(s.key)

    def _advance(self, st: StepState) -> Outcome:
        """Commit the passers of the current round that are certain to be among its first
        `commit_slots` in slot order; once the round is resolved, put its other passers into the
        prompt reserve in slot order and start a fill round while the step is short of B commits."""
        out = Outcome()
        while st.rounds:
            current = st.rounds[-1]
            passed_before = unresolved_before = 0
            for slot in current.slots:
                s = st.slots[slot]
                if s.status == PENDING:
                    unresolved_before += 1
                    continue
                if s.status in (SOLVED, DEFERRED):
                    continue
                if s.status == PASSED:
                    if passed_before + unresolved_before < current.commit_slots:
                        s.status = COMMITTED
                        st.committed += 1
                        st.counts["pilot/committed"] += 1
                        out.requests.append(self._request(st, slot, COMMIT))
                    elif passed_before >= current.commit_slots:
                        s.status = SURPLUS
                passed_before += 1
            if unresolved_before:
                return out
            if self.pilot.fill_from != "loader":       # "loader": fills never read the reserve, so keep none
                for slot in current.slots:
                    key = st.slots[slot].key
                    if st.slots[slot].status == SURPLUS and key not in self._solved and key not in self._deferred:
                        self.replay.add(key, st.step)
                        st.counts["pilot/replay_added"] += 1
            slots = self._fill_slots(st)
            if not slots:
                return out
            out.requests += self._start_round(st, slots)
        return out

    def _fill_slots(self, st: StepState) -> list[int]:
        """The next fill round's slots: passers from the reserve, each while a full K fits the
        budget, then fresh prompts from the loader, as many as num_candidates and the budget allow
        with room for one commit after their pilots. None once B are committed."""
        need = self.batch_size - st.committed
        if need <= 0:
            return []
        keys = []
        if self.pilot.fill_from != "loader":
            n = min(need, (st.budget - st.spent) // st.group_size, self.replay.available(st.step))
            keys = self.replay.take(max(n, 0), st.step)
            st.counts["pilot/replayed"] += len(keys)
        slots = [self._new_slot(st, Candidate(k, self._epoch)) for k in keys]
        if self.pilot.fill_from != "reserve" and need > len(keys):
            n_commit = st.group_size - st.n_pilot
            left = st.budget - st.spent - len(keys) * st.group_size - n_commit
            n = min(self.pilot.resolved_candidates(self.batch_size), left // st.n_pilot)
            if n > 0:
                fresh = self._draw(st, n)
                st.counts["pilot/fresh_filled"] += len(fresh)
                slots += [self._new_slot(st, c) for c in fresh]
        return slots

    def _pilot_metrics(self, st: StepState) -> dict[str, float]:
        """The metrics of a step that only the pilot has, computed when it ends."""
        piloted = st.counts["pilot/piloted"]
        stds = [s.pilot_std for _, s in sorted(st.slots.items()) if s.pilot_std is not None]
        return {"pilot/selected_ratio": st.counts["pilot/committed"] / piloted if piloted else 0.0,
                "pilot/replay_size": float(len(self.replay)),
                "pilot/reward_std": sum(stds) / len(stds) if stds else 0.0,
                "pilot/budget": float(st.budget),
                "pilot/solved_total": float(len(self._solved)),
                "pilot/deferred_pending": float(len(self._deferred))}
