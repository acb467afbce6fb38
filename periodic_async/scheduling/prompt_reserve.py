"""The keys of surplus prompts kept for a later step, with an age limit (torch-free). Prompt keys
only: no experience (rollouts, rewards, log-probs) is ever held here. (The config key
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

`PromptKey` is whatever identifies a prompt to the caller (a record index or a string); the
reserve only compares and stores it, and the state dict keeps it as it is (JSON int or str).
"""
from __future__ import annotations

from typing import Any, Hashable

PromptKey = Hashable      # an int record index or a string; JSON keeps either as it is


class PromptReserve:
    """Keys of surplus prompts with the step each was added in, oldest first."""

    def __init__(self, max_age: int):
        if max_age < 0:
            raise ValueError(f"PromptReserve: max_age must be >= 0 steps, got {max_age}")
        self.max_age = max_age
        self._added: dict[PromptKey, int] = {}       # insertion-ordered: key -> step it was added in

    def __len__(self) -> int:
        return len(self._added)

    def __contains__(self, key: PromptKey) -> bool:
        return key in self._added

    def add(self, key: PromptKey, step: int) -> None:
        self._added.pop(key, None)
        self._added[key] = step

    def discard(self, key: PromptKey) -> bool:
        """Remove `key` if held (it was drawn again, solved or deferred); True if it was held."""
        return self._added.pop(key, None) is not None

    def expire(self, step: int) -> int:
        """Drop entries older than max_age at `step`; the number dropped."""
        old = [k for k, added in self._added.items() if step - added > self.max_age]
        for k in old:
            del self._added[k]
        return len(old)

    def available(self, step: int) -> int:
        """How many entries `take(., step)` could return: those added before `step`."""
        return sum(1 for added in self._added.values() if added < step)

    def take(self, n: int, step: int) -> list[PromptKey]:
        """Remove and return up to n keys added before `step`, oldest first. An entry added at
        `step` itself passed under this very policy and was left out for want of room, so it waits
        for a later step."""
        taken = [k for k, added in self._added.items() if added < step][:max(n, 0)]
        for k in taken:
            del self._added[k]
        return taken

    def entries(self) -> list[tuple[PromptKey, int]]:
        """(key, step added), oldest first."""
        return list(self._added.items())

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable; the age limit is configuration and is not saved, so a resumed run may
        change it (entries are then judged by the new limit at the next `expire`)."""
        return {"entries": [[k, s] for k, s in self._added.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._added = {}
        for key, step in state["entries"]:
            self._added[key_from_json(key)] = int(step)


def key_from_json(key: Any) -> PromptKey:
    """JSON has no tuples: a tuple key comes back as a list and is restored as a tuple."""
    return tuple(key_from_json(k) for k in key) if isinstance(key, list) else key
