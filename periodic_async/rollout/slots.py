"""The pool's worker slots (rollout/worker.py): a handle per worker - a local process with its
queue and result pipe, or a relay's connection for a worker on another node - and the listener
that accepts those relays (rollout/remote.py) and reads their Hello."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Iterator

from .messages import Hello

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    process: object | None         # a multiprocessing Process; None: a worker on another node
    inbox: object                  # .put(msg) reaches the worker
    reader: object                 # the read end of this worker's result pipe (None once broken)
    pid: int = 0
    last_progress: float = 0.0
    remote: bool = False
    ready: bool = False            # said Ready (and, broadcast sync, paired)

    def alive(self) -> bool:
        if self.remote:
            return self.reader is not None
        return self.process.is_alive()


class ConnectionInbox:
    """A remote worker's inbox: messages go over its relay's connection (a broken one shows up
    as EOF on the read side, where the pool handles it)."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            pass


class RelayListener:
    """Accepts relays' connections at `address` (HOST:PORT; port 0: any free one) on a thread of
    its own, authenticated with the shared key (remote.rollout_key); `hellos()` hands over the
    ones that introduced themselves."""

    def __init__(self, address: str):
        from multiprocessing.connection import Listener

        from ..netaddr import split_address
        from .remote import rollout_key
        self._listener = Listener(split_address(address), authkey=rollout_key())
        self.address = "%s:%d" % self._listener.address
        self._arrivals: queue.Queue = queue.Queue()
        self._closed = False
        threading.Thread(target=self._accept, name="rollout-listener", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                self._arrivals.put(self._listener.accept())
            except Exception as e:  # noqa: BLE001 - a wrong key, a port scan: log, keep listening
                if self._closed:
                    return
                log.warning("rollout pool: refused a connection at %s (%s)", self.address, e)

    def hellos(self) -> Iterator[tuple[object, Hello]]:
        """(connection, its Hello) for each relay accepted since the last call; one that sends no
        Hello within 10 s, or something else, is closed."""
        while True:
            try:
                conn = self._arrivals.get_nowait()
            except queue.Empty:
                return
            try:
                if not conn.poll(10):
                    raise EOFError("no hello")
                hello = conn.recv()
                if not isinstance(hello, Hello):
                    raise ValueError(f"expected a Hello, got {type(hello).__name__}")
            except (EOFError, OSError, ValueError, TypeError) as e:
                log.warning("rollout pool: a relay's hello failed (%s)", e)
                conn.close()
                continue
            yield conn, hello

    def close(self) -> None:
        self._closed = True
        self._listener.close()
