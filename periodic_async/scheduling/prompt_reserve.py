"""The keys of surplus prompts kept for a later step, with an age limit (torch-free). Prompt keys,
and with rollout.pilot.reuse_pilots the pilot's rewards and policy version (`PilotRecord`); the
rollouts themselves are never held here (the planner keeps them: scheduling/plan.py). (The config key
rollout.pilot.replay_max_age, the `pilot/replay_*` metrics and the "replay" entry of the
allocator's state keep the older name "replay buffer".)

A prompt whose pilot passed but that did not get a commit this step (the step's budget or its B
groups were already taken) goes here, so a later step where too few pilots pass can still train
on B groups. Only the prompt key is kept, never its rollouts: a replayed prompt is piloted and
committed afresh under the policy of the step that uses it, so training stays strictly on-policy.

Age is counted in steps: an entry added at step s has age t - s at step t, and is usable while its
age is at most `max_age`; `expire(t)` discards the older ones and says how many. Entries are
served oldest first (ties in insertion order), which spends entries before they expire. A key is
held at most once; adding it again refreshes its step and moves it to the back.

With rollout.pilot.reuse_pilots (async, eta > 0) an entry also carries its pilot's `PilotRecord`,
so a later step within eta versions may commit on the stored pilot rollouts instead of piloting
again (pilot_commit.py), and `by_variance` serves the entries with the most varied pilot rewards
first, as the official buffer samples them. Records are not saved in the state dict: the rollouts
they stand for are not in a checkpoint, so a resumed run pilots those prompts afresh.

`PromptKey` is whatever identifies a prompt to the caller (a record index or a string); the
reserve only compares and stores it, and the state dict keeps it as it is (JSON int or str).
"""
from __future__ import annotations

import math
from typing import Any, Hashable, NamedTuple, Optional

PromptKey = Hashable      # an int record index or a string; JSON keeps either as it is


class PilotRecord(NamedTuple):
    """What the allocator keeps of a surplus passer's pilot for reuse (its rollouts are the planner's)."""
    rewards: tuple[float, ...]      # in sample-index order, 0..n_pilot-1
    version: int                    # the oldest policy version among the pilot's samples

    @property
    def n_pilot(self) -> int:
        return len(self.rewards)

    @property
    def std(self) -> float:
        return reward_std(self.rewards)


def reward_std(rewards) -> float:
    """Population standard deviation of a pilot's rewards (the variance the reserve is served by)."""
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


class PromptReserve:
    """Keys of surplus prompts with the step each was added in, oldest first."""

    def __init__(self, max_age: int):
        if max_age < 0:
            raise ValueError(f"PromptReserve: max_age must be >= 0 steps, got {max_age}")
        self.max_age = max_age
        self._added: dict[PromptKey, int] = {}       # insertion-ordered: key -> step it was added in
        self._records: dict[PromptKey, PilotRecord] = {}    # reuse_pilots: the entry's pilot

    def __len__(self) -> int:
        return len(self._added)

    def __contains__(self, key: PromptKey) -> bool:
        return key in self._added

    def add(self, key: PromptKey, step: int, record: Optional[PilotRecord] = None) -> None:
        self.discard(key)
        self._added[key] = step
        if record is not None:
            self._records[key] = record

    def discard(self, key: PromptKey) -> bool:
        """Remove `key` if held (it was drawn again, solved or deferred); True if it was held."""
        self._records.pop(key, None)
        return self._added.pop(key, None) is not None

    def record(self, key: PromptKey) -> Optional[PilotRecord]:
        """The entry's stored pilot (reuse_pilots), or None."""
        return self._records.get(key)

    def expire(self, step: int) -> int:
        """Drop entries older than max_age at `step`; the number dropped."""
        old = [k for k, added in self._added.items() if step - added > self.max_age]
        for k in old:
            self.discard(k)
        return len(old)

    def serving_order(self, step: int, by_variance: bool = False) -> list[PromptKey]:
        """The keys `take` may return at `step` (added before it), in the order they are served:
        oldest first, or by_variance: the highest pilot reward std first (entries without a record
        last), oldest first among equals."""
        keys = [k for k, added in self._added.items() if added < step]
        if by_variance:
            keys.sort(key=lambda k: -self._records[k].std if k in self._records else 1.0)   # stable: oldest first
        return keys

    def available(self, step: int) -> int:
        """How many entries `take(., step)` could return: those added before `step`."""
        return sum(1 for added in self._added.values() if added < step)

    def take(self, n: int, step: int) -> list[PromptKey]:
        """Remove and return up to n keys added before `step`, oldest first. An entry added at
        `step` itself passed under this very policy and was left out for want of room, so it waits
        for a later step."""
        taken = self.serving_order(step)[:max(n, 0)]
        for k in taken:
            self.discard(k)
        return taken

    def entries(self) -> list[tuple[PromptKey, int]]:
        """(key, step added), oldest first."""
        return list(self._added.items())

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable; the age limit is configuration and is not saved, so a resumed run may
        change it (entries are then judged by the new limit at the next `expire`)."""
        return {"entries": [[k, s] for k, s in self._added.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._added, self._records = {}, {}
        for key, step in state["entries"]:
            self._added[key_from_json(key)] = int(step)


def key_from_json(key: Any) -> PromptKey:
    """JSON has no tuples: a tuple key comes back as a list and is restored as a tuple."""
    return tuple(key_from_json(k) for k in key) if isinstance(key, list) else key
