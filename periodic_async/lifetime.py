"""Child processes die with the process that started them, even when it is SIGKILLed.

Torch-free, so a multiprocessing child can call it as its initializer without importing torch.
"""
from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); a no-op elsewhere."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass
