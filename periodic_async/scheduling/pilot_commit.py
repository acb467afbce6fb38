"""The pilot-commit part of the allocator (allocation.py; rollout.pilot, docs/allocation.md):
a round of pilots, each pilot's verdict (solved, deferred, passed), the commits of the first
passers in slot order, the surplus passers into the prompt reserve, and the fill rounds from it.
Torch-free and deterministic.

`PilotCommit` is a mixin of `Allocator`, not a class of its own: it works on the allocator's
run state (`pilot`, `batch_size`, the solved and deferred sets, the prompt reserve `replay`, the
latest loader `_epoch`, the thresholds `_p_lower` / `_p_upper`) and its request book-keeping
(`_request`, `_new_slot`), always under the allocator's lock.
"""
from __future__ import annotations

import math

from ..config.allocation import classify
from .alloc_types import (COMMIT, COMMITTED, DEFERRED, PASSED, PENDING, PILOT, SOLVED, SURPLUS, AllocRequest,
                          Candidate, Outcome, Round, SlotState, StepState)


class PilotCommit:
    """Pilot rounds, verdicts, commits and fill rounds (see the module docstring)."""

    def _start_round(self, st: StepState, slots: list[int]) -> list[AllocRequest]:
        requests = [self._request(st, slot, PILOT) for slot in slots]
        n_commit = st.group_size - self.pilot.n_pilot
        room = min(self.batch_size - st.committed, (st.budget - st.spent) // n_commit)
        st.rounds.append(Round(slots, max(room, 0)))
        st.counts["pilot/piloted"] += len(slots)
        return requests

    def _on_pilot(self, st: StepState, s: SlotState, rewards: tuple[float, ...]) -> None:
        successes = sum(1 for r in rewards if r >= self.pilot.success_threshold)
        mean = sum(rewards) / len(rewards)
        s.pilot_std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        verdict = classify(successes, len(rewards), self._p_lower, self._p_upper)
        if verdict == "solved":
            s.status = SOLVED
            st.counts["pilot/solved_dropped"] += 1
            self._solved[s.key] = None
            self._deferred.pop(s.key, None)
            self.replay.discard(s.key)
        elif verdict == "deferred":
            s.status = DEFERRED
            st.counts["pilot/deferred"] += 1
            if s.key not in self._solved:
                self._deferred[s.key] = max(s.epoch, self._deferred.get(s.key, s.epoch))
            self.replay.discard(s.key)
        else:
            s.status = PASSED

    def _advance(self, st: StepState) -> Outcome:
        """Commit the passers of the current round that are certain to be among its first
        `commit_slots` in slot order; once the round is resolved, put its other passers into the
        prompt reserve in slot order and start a fill round from the prompt reserve."""
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
            for slot in current.slots:
                key = st.slots[slot].key
                if st.slots[slot].status == SURPLUS and key not in self._solved and key not in self._deferred:
                    self.replay.add(key, st.step)
                    st.counts["pilot/replay_added"] += 1
            fill = min(self.batch_size - st.committed, (st.budget - st.spent) // st.group_size,
                       self.replay.available(st.step))
            if fill <= 0:
                return out
            keys = self.replay.take(fill, st.step)
            st.counts["pilot/replayed"] += len(keys)
            out.requests += self._start_round(st, [self._new_slot(st, Candidate(k, self._epoch)) for k in keys])
        return out

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
