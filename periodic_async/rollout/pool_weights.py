"""The weights half of the rollout worker pool (rollout/worker.py's WorkerPool inherits it): the
buffer the workers load from, synchronous and posted updates, and the broadcast sync's pairing.

Weight sync (one node): the trainer writes the policy's HF-layout tensors into ONE flat
shared-memory buffer (weights_buffer.py) and tells every worker the new version; each worker copies
from the buffer into its engine when it is idle and acknowledges. The pool dispatches the next
batch only after every worker has acknowledged, so every sample of batch t comes from policy t. In
the async mode (`post_weights`) the update reaches workers that are generating: an interruptible
engine takes it between two decode steps, any other once drained; acknowledgements are collected by
whoever reads the workers' messages (`poll`). Broadcast sync (weight_sync.py): the pool sends the
buffer over a process group per worker instead (workers on other nodes).

The methods use the pool's state (set up in WorkerPool.__init__) and its `_await` / `_restart`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .messages import Ready, Update, Updated, WorkerError
from .weights_buffer import Layout, write_buffer


class PoolWeights:
    def _named_buffer(self, settings, layout: Layout, dtype: torch.dtype):
        """The weights buffer as a named file (weight_sync.SharedWeights), for vLLM engines whose
        TP processes load from it; removed when the pool closes or is collected."""
        if settings.engine != "vllm" or settings.weight_sync != "shm":
            raise ValueError(f"tensor_parallel_size {settings.tensor_parallel_size} needs engine 'vllm' and "
                             f"weight_sync 'shm' (got '{settings.engine}', '{settings.weight_sync}')")
        import weakref

        from .weight_sync import SharedWeights
        shared = SharedWeights.create(layout, dtype)
        self._unlink_buffer = weakref.finalize(self, shared.unlink)
        return shared

    def _worker_buffer(self):
        """What a local worker gets of the buffer: the shared tensor, or its named handle (TP > 1)."""
        return self._buf if self._shared is None else self._shared

    def _pair_with(self, wid: int) -> None:
        """Broadcast sync: join a (re)started worker's pair group and send it the current weights
        unless it starts from them (the checkpoint at version 0)."""
        from . import weight_sync
        group = weight_sync.pair_group(self.settings.backend, self._store, None, self._keys[wid], rank=0,
                                       timeout_s=self.startup_timeout_s)
        self._pairs[wid] = group
        if self.version > 0 or self.settings.load_format == "dummy":
            weight_sync.send_weights(group, self.settings.backend, self._buf, self._plan)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the new weights into the shared buffer, then wait until every worker has them."""
        # a remote worker that connected but is not ready yet was given the previous version: it
        # must be paired (and hold those weights) before the update below can reach it
        joining = {wid for wid, h in enumerate(self._workers) if h.remote and h.reader is not None and not h.ready}
        if joining:
            self._await(Ready, joining, self.startup_timeout_s)
        self._write_buffer(named_tensors)
        self.version = version
        for h in self._workers:
            if h.inbox is not None:
                h.inbox.put(Update(version))
        if self.settings.weight_sync == "broadcast":
            from . import weight_sync
            for wid in list(self._pairs):
                try:
                    weight_sync.send_weights(self._pairs[wid], self.settings.backend, self._buf, self._plan)
                except RuntimeError as e:   # the worker died: its restart receives version `version`
                    self._restart(wid, f"failed during the weight broadcast ({e})")
        self._await(Updated, {wid for wid, h in enumerate(self._workers) if not h.remote or h.reader is not None},
                    self.startup_timeout_s, version=version)
        self.applied_version = version

    def post_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Asynchronous update (trainer.mode async; the shm sync only): once every worker holds the
        previous posted version, write these weights into the buffer and tell every worker; returns
        without waiting for them. Workers take the update between two decode steps (an
        interruptible engine) or once drained; `poll`, on the thread that reads the workers,
        collects the acks and advances `applied_version`."""
        if self.settings.weight_sync != "shm":
            raise ValueError("post_weights: asynchronous updates need weight_sync 'shm'")
        if not self._acked.wait(self.startup_timeout_s):
            raise WorkerError(f"rollout workers {sorted(self._awaiting)} did not take weights version {self.version} "
                              f"within {self.startup_timeout_s:.0f} s")
        with self._lock:
            self._write_buffer(named_tensors)
            self.version = version
            self._awaiting = {wid for wid, h in enumerate(self._workers) if h.inbox is not None}
            self._acked.clear()
            for wid in self._awaiting:
                self._workers[wid].inbox.put(Update(version))

    def _write_buffer(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a full set of HF-layout tensors into the buffer (weights_buffer.write_buffer)."""
        write_buffer(self._buf, self.layout, named_tensors)
