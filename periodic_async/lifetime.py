"""Child processes die with the process that started them, even when it is SIGKILLed.

Torch-free, so a multiprocessing child can call it as its initializer without importing torch.
"""
from __future__ import annotations

import os
import signal


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); a no-op elsewhere.

    A parent that died before the request (a rollout worker imports torch first, seconds in which
    its trainer may be SIGKILLed) sends no signal any more: a multiprocessing child whose parent is
    gone already kills itself here (such a worker, spawned just before its trainer was SIGKILLed,
    ran on: tests/test_lifetime.py)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        return
    import multiprocessing
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)
