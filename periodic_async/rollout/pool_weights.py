"""The weights half of the rollout worker pool (rollout/worker.py's WorkerPool inherits it): the
buffer the workers load from, the one update protocol, and the broadcast sync's pairing.

One protocol for every mode and every sync: `publish(weights, version)` writes the policy's
HF-layout tensors into ONE flat buffer (weights_buffer.py; shared memory on one node) and tells
every worker the new version, without waiting; each worker takes it when its engine can (between
two decode steps if interruptible, else once drained) and acknowledges; the acks are collected by
whoever reads the workers' messages (`poll`), and `applied_version` advances once every worker
holds the version. The producer dispatches batch t only once `applied_version` allows it
(scheduling/staleness.py), so with eta = 0 every sample of batch t comes from policy t; with eta >
0 workers take the update mid-generation. Broadcast sync (weight_sync.py, workers on other nodes):
a worker that takes an update says so (Receiving) and the pool sends it the buffer over the
worker's own process group, from a sender thread.

The methods use the pool's state (set up in WorkerPool.__init__) and its `_await` / `_restart`.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable

import torch

from .messages import Ready, Update, Updated
from .weights_buffer import Layout, write_buffer

log = logging.getLogger(__name__)


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

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make `version` the pool's weights and tell every worker; returns without waiting for
        them (the one weight protocol of every sync: shm, broadcast, remote workers). The previous
        version must be applied (`wait_applied`): the buffer it is read from is rewritten here.
        A worker takes the update between two decode steps (an interruptible engine) or once
        drained, and acknowledges (Updated); the acks are collected by whoever reads the workers'
        messages (`poll`, `_await`), which advances `applied_version` once every worker has it.
        Broadcast: a worker that takes the update says so (Receiving) and the pool then sends it
        the buffer from a thread of its own, so neither side waits on the other's generation."""
        if self.applied_version != self.version:
            raise RuntimeError(f"publish: weights version {self.version} is not yet applied by workers "
                               f"{sorted(self._awaiting)} (wait_applied first)")
        # a remote worker that connected but is not ready yet was given the previous version: it
        # must be paired (and hold those weights) before this update can reach it
        joining = {wid for wid, h in enumerate(self._workers) if h.remote and h.reader is not None and not h.ready}
        if joining:
            self._await(Ready, joining, self.startup_timeout_s)
        with self._lock:
            for t in self._senders.values():     # every worker acked: their sends are done, or about to be
                t.join(timeout=self.startup_timeout_s)
            self._senders.clear()
            self._write_buffer(named_tensors)
            self.version = version
            self._awaiting = {wid for wid, h in enumerate(self._workers) if h is not None and h.inbox is not None}
            if self._awaiting:
                self._acked.clear()
            else:
                self.applied_version = version
            for wid in self._awaiting:
                self._workers[wid].inbox.put(Update(version))

    def wait_applied(self, timeout: float) -> bool:
        """True once every worker holds `version` (someone must be reading their messages)."""
        return self._acked.wait(timeout)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """`publish`, then wait until every worker has the version, reading their messages here:
        for a caller with no thread polling the pool (results that arrive meanwhile are kept)."""
        if not self._acked.is_set():
            self._await(Updated, set(self._awaiting), self.startup_timeout_s, version=self.version)
        self.publish(named_tensors, version)
        if self._awaiting:
            self._await(Updated, set(self._awaiting), self.startup_timeout_s, version=version)

    def _on_ack(self, wid: int, version: int | None = None) -> None:
        """Worker `wid` holds the pool's version (an Updated, or a restarted worker's Ready, at
        `version`), or left the pool (None: vacated; it gets the weights when it reconnects)."""
        if version is not None and version != self.version:
            return
        with self._lock:
            self._awaiting.discard(wid)
            if not self._awaiting and self.applied_version != self.version:
                self.applied_version = self.version
                self._acked.set()

    def _send_to(self, wid: int, version: int) -> None:
        """Broadcast sync: worker `wid` is receiving `version`; send it the buffer from a thread
        of the pool's own (the producer thread goes on reading results meanwhile)."""
        from . import weight_sync
        group = self._pairs.get(wid)
        if group is None or version != self.version:
            return      # restarted or vacated meanwhile: it is sent the weights when it pairs again
        device = self._sync_device

        def send() -> None:
            try:
                weight_sync.send_weights(group, self.settings.backend, self._buf, self._plan, device=device)
            except RuntimeError as e:   # the worker died: the health check restarts it (with `version`)
                if self._pairs.get(wid) is group:     # not restarted meanwhile
                    log.warning("weight broadcast to rollout worker %d failed (%s)", wid, e)
                    self._send_failed.add(wid)

        t = threading.Thread(target=send, name=f"weights-to-worker-{wid}", daemon=True)
        self._senders[wid] = t
        t.start()

    def _write_buffer(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a full set of HF-layout tensors into the buffer (weights_buffer.write_buffer)."""
        write_buffer(self._buf, self.layout, named_tensors)
