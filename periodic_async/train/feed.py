"""The batch's groups on every trainer rank: rank 0's scored groups, handed to every other rank in
completion order (which DP rank then trains on which group is scheduling/dp_assignment.py's rule).

Rank 0 owns the rollout side. With more than one rank, a thread on each rank takes part in one
object broadcast per group on a dedicated gloo group, so feeding never interleaves with the
training collectives (pipeline p2p, TP all-reduces) on the main thread - a pipeline stage waiting
for activations would otherwise deadlock against a stage waiting in a broadcast. The first
broadcast carries the batch's group sizes: each DP rank must know its micro-batch count before the
pipeline schedule starts. An error on rank 0's side is broadcast too, so every rank raises instead
of waiting forever.
"""
from __future__ import annotations

import queue
import threading

import torch.distributed as dist


class GroupFeed:
    """sizes: {group index: K} of the batch (rank 0; other ranks receive it). groups: rank 0's
    iterator of scored groups in completion order. group: the gloo group for the broadcasts
    (None with one rank)."""

    def __init__(self, sizes: dict[int, int] | None, groups, group):
        self._iter = groups
        self._q = None
        self.sizes = sizes
        if dist.get_world_size() > 1:
            self._q = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(sizes, groups, group), daemon=True,
                                            name="group-feed")
            self._thread.start()
            self.sizes = self._get()
        self.n = len(self.sizes)

    def _run(self, sizes, groups, group) -> None:
        try:
            box = [sizes]
            dist.broadcast_object_list(box, src=0, group=group)
            self._q.put(box[0])
            for _ in range(len(box[0])):
                box = [None]
                if dist.get_rank() == 0:
                    try:
                        box = [next(groups)]
                    except Exception as e:   # noqa: BLE001 - handed to every rank below
                        box = [_FeedError(f"{type(e).__name__}: {e}")]
                        self._q.put(e)
                        dist.broadcast_object_list(box, src=0, group=group)
                        return
                dist.broadcast_object_list(box, src=0, group=group)
                self._q.put(box[0] if not isinstance(box[0], _FeedError) else RuntimeError(
                    f"rank 0's rollout side failed: {box[0].message}"))
                if isinstance(box[0], _FeedError):
                    return
            if dist.get_rank() == 0:
                _expect_end(groups)
        except Exception as e:   # noqa: BLE001
            self._q.put(e)

    def _get(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def get(self):
        """The next group (blocks until rank 0 has it)."""
        if self._q is None:
            return next(self._iter)
        return self._get()

    def close(self) -> None:
        if self._q is None:
            if self._iter is not None:
                _expect_end(self._iter)
            return
        self._thread.join()


class _FeedError:
    def __init__(self, message: str):
        self.message = message


def _expect_end(groups) -> None:
    for _ in groups:   # drain the end-of-batch marker
        raise RuntimeError("the rollout producer produced more groups than the batch has prompts")
