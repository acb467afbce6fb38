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
(as many as num_candidates, and as leave room for at least one commit). With reuse_pilots in
async (eta > 0), a reserve entry keeps its pilot's rewards and version (the planner its rollouts),
the reserve is served most varied pilot first, and an entry whose pilot is within eta versions of
the step's trainer version is committed on it at once (`_take_reserve`).

`PilotCommit` is a mixin of `Allocator`, not a class of its own: it works on the allocator's
run state (`pilot`, `batch_size`, the evicted and deferred maps, the prompt reserve `replay`, the
latest loader `_epoch`, the `_thresholds`) and its request book-keeping (`_draw`, `_request`,
`_new_slot`), always under the allocator's lock.
"""
from __future__ import annotations

from .alloc_types import (COMMIT, COMMITTED, DEFERRED, PASSED, PENDING, PILOT, SOLVED, SURPLUS, AllocRequest,
                          Candidate, Outcome, Round, SlotState, StepState)
from .prompt_reserve import PilotRecord, reward_std


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
        s.pilot_std = reward_std(rewards)
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
                    s = st.slots[slot]
                    if s.status == SURPLUS and s.key not in self._solved and s.key not in self._deferred:
                        record = None
                        if self.reuses_rollouts and s.pilot_version is not None:
                            record = PilotRecord(s.rewards[PILOT], s.pilot_version)
                            out.kept.append((slot, s.key))
                        self.replay.add(s.key, st.step, record)
                        st.counts["pilot/replay_added"] += 1
            slots, commits = self._fill_slots(st)
            out.requests += commits
            if not slots:
                return out
            out.requests += self._start_round(st, slots)
        return out

    def _reusable(self, st: StepState, key) -> bool:
        """Whether the reserve's `key` may be committed on its stored pilot at this step: the step
        is trained at version step - 1, and every pilot sample must be at most eta versions old
        then (the staleness rule's bound), with this step's n_pilot."""
        record = self.replay.record(key)
        return (self.reuses_rollouts and record is not None and record.n_pilot == st.n_pilot
                and 0 <= (st.step - 1) - record.version <= self.max_staleness)

    def _take_reserve(self, st: StepState, need: int) -> tuple[list, list[AllocRequest]]:
        """reuse_pilots: the reserve's entries for a fill round, most varied pilot first: each
        reusable one is committed on its stored pilot at once while its K - n_pilot rollouts fit
        the budget, each other one piloted again while a full K fits. (The keys to pilot, the
        commit requests.)"""
        keys, commits = [], []
        left = st.budget - st.spent
        for key in self.replay.serving_order(st.step, by_variance=True):
            if len(keys) + len(commits) >= need:
                break
            reuse = self._reusable(st, key)
            cost = st.group_size - st.n_pilot if reuse else st.group_size
            if cost > left:
                continue
            left -= cost
            record = self.replay.record(key)
            self.replay.discard(key)
            if not reuse:
                keys.append(key)
                continue
            slot = self._new_slot(st, Candidate(key, self._epoch))
            s = st.slots[slot]
            s.requests[PILOT] = AllocRequest(slot, key, PILOT, st.group_size, tuple(range(st.n_pilot)), reused=True)
            s.rewards[PILOT], s.pilot_version = record.rewards, record.version     # pilot_std: this step's pilots only
            s.status = COMMITTED
            st.committed += 1
            st.counts["pilot/committed"] += 1
            st.counts["pilot/reused"] += 1
            st.reused.add(key)
            commits.append(self._request(st, slot, COMMIT))
        st.counts["pilot/replayed"] += len(keys)
        return keys, commits

    def _fill_slots(self, st: StepState) -> tuple[list[int], list[AllocRequest]]:
        """The next fill round's slots: passers from the reserve, each while a full K fits the
        budget, then fresh prompts from the loader, as many as num_candidates and the budget allow
        with room for one commit after their pilots. None once B are committed. With reuse, also
        the commits of reserve entries reused on their stored pilots (`_take_reserve`)."""
        need = self.batch_size - st.committed
        if need <= 0:
            return [], []
        keys, commits = [], []
        if self.pilot.fill_from != "loader":
            if self.reuses_rollouts:
                keys, commits = self._take_reserve(st, need)
                need -= len(commits)
            else:
                n = min(need, (st.budget - st.spent) // st.group_size, self.replay.available(st.step))
                keys = self.replay.take(max(n, 0), st.step)
                st.counts["pilot/replayed"] += len(keys)
        slots = [self._new_slot(st, Candidate(k, self._epoch)) for k in keys]
        if need <= 0:
            return slots, commits
        if self.pilot.fill_from != "reserve" and need > len(keys):
            n_commit = st.group_size - st.n_pilot
            left = st.budget - st.spent - len(keys) * st.group_size - n_commit
            n = min(self.pilot.resolved_candidates(self.batch_size), left // st.n_pilot)
            if n > 0:
                fresh = self._draw(st, n)
                st.counts["pilot/fresh_filled"] += len(fresh)
                slots += [self._new_slot(st, c) for c in fresh]
        return slots, commits

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
