"""The per-device set-up of the device stack, applied once per process by `backend.get_backend`:
the CPU shims that let Megatron-core (written for CUDA) run on the CPU, the CUDA check, torch_npu
and, in trainer processes, MindSpeed's Megatron adaptor on Ascend; and the filter for
Megatron-core's import-time fallback warnings. Part of the backend layer (backend.py): every
device-specific line of the project lives in these two modules.

Asking for a stack that is not there raises `BackendUnavailable` with one line saying what is
missing and how to install it.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import warnings
from typing import Optional

import torch

from .errors import InputError


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine; the message says what to install."""


# Megatron-core warns at import, once per module that has a fallback (four of them), in every
# process that imports it, when neither Transformer Engine nor Apex is installed; the fallbacks
# are what the cpu backend runs on. `quiet_megatron_fallbacks` filters exactly these warnings;
# the CLI says the fact once instead (`megatron_fallback_note`).
MEGATRON_FALLBACK_WARNING = r"Transformer Engine and Apex are not installed\. Falling back to"


def quiet_megatron_fallbacks() -> None:
    """Filter Megatron-core's 'Transformer Engine and Apex are not installed. Falling back to ...'
    warnings in this process (by message; every other warning still shows)."""
    warnings.filterwarnings("ignore", message=MEGATRON_FALLBACK_WARNING, category=UserWarning)


def megatron_fallback_note() -> Optional[str]:
    """One line saying which of Apex / Transformer Engine is missing (None when both are there)."""
    missing = [name for name, module in (("Apex", "apex"), ("Transformer Engine", "transformer_engine"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    if len(missing) == 1:
        return f"{missing[0]} is not installed (optional; Megatron-core uses what is there)"
    return ("Apex and Transformer Engine are not installed: Megatron-core uses its local fallbacks (torch "
            "optimizers, local multi-tensor kernels)")


_CPU_TORCH_SHIM_APPLIED = False
_CPU_MEGATRON_SHIM_APPLIED = False


def apply_cpu_megatron_shims(megatron: bool = True) -> None:
    """Megatron-core assumes CUDA. On CPU, map the CUDA calls it makes onto the CPU device - the
    same idea as torch_npu's `transfer_to_npu` on Ascend:
    - `torch.cuda.current_device()` is passed as a `device=` in ~580 places: return "cpu";
    - `torch.cuda.synchronize()` (pipeline p2p) becomes a no-op;
    - `Tensor.cuda()` returns the tensor itself; `torch.zeros(device="cuda")` and the like in the
      pipeline schedules and the gradient-norm code (optimizer/clip_grads, utils) are made on CPU.
    megatron=False (a rollout worker) applies the three torch-level redirects only: patching
    Megatron's modules imports Megatron-core, ~3 s of a CPU worker's start that it never uses.
    Applied once per part, idempotent, only for the cpu backend."""
    global _CPU_TORCH_SHIM_APPLIED, _CPU_MEGATRON_SHIM_APPLIED
    if not _CPU_TORCH_SHIM_APPLIED:
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        # With PP > 1 and tied embeddings, the last stage's copy is moved with `.cuda()` before its
        # first all-reduce: on the cpu backend a tensor already is where it should be
        # (transfer_to_npu maps the same call to the NPU).
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]
        _CPU_TORCH_SHIM_APPLIED = True
    if not megatron or _CPU_MEGATRON_SHIM_APPLIED:
        return
    # The pipeline schedules count tokens in `torch.zeros(..., device="cuda")`: give that module
    # a torch whose factory functions map "cuda" to the CPU (nothing else changes).
    quiet_megatron_fallbacks()
    import megatron.core.utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules
    for module in (schedules, clip_grads, mcore_utils):
        module.torch = _CpuDeviceTorch()
    _CPU_MEGATRON_SHIM_APPLIED = True


class _CpuDeviceTorch:
    """`torch` as seen by Megatron's schedules on the cpu backend: device="cuda" becomes "cpu"."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def ones(self, *args, **kwargs):
        return torch.ones(*args, **self._cpu(kwargs))

    def empty(self, *args, **kwargs):
        return torch.empty(*args, **self._cpu(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))


# glibc's mallopt parameters (malloc.h) and hold_host_heap's values for them
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_HELD_HEAP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2 ** 31 - 1, _M_TOP_PAD: 64 << 20}
# the same settings through glibc's environment, for a process that is not ours (a benchmark's
# other side): read by glibc at start-up
HELD_HEAP_GLIBC_ENV = {f"MALLOC_{name}_": str(_HELD_HEAP[param]) for name, param in
                       (("MMAP_MAX", _M_MMAP_MAX), ("TRIM_THRESHOLD", _M_TRIM_THRESHOLD), ("TOP_PAD", _M_TOP_PAD))}
HOST_MALLOC_ENV = "PERIODIC_ASYNC_HOST_MALLOC"     # "system" leaves glibc's defaults alone
_HOST_HEAP_HELD: Optional[bool] = None


def host_malloc_env(setting: str) -> dict[str, str]:
    """The environment a benchmark gives a child process for an allocator setting: "system" - a
    project process with glibc's defaults (the opt-out); "held" - any process, the project's or
    not, with hold_host_heap's settings through glibc's variables; "" - nothing added."""
    envs = {"": {}, "system": {HOST_MALLOC_ENV: "system"}, "held": HELD_HEAP_GLIBC_ENV}
    if setting not in envs:
        raise ValueError(f"allocator setting {setting!r}: allowed system, held or none")
    return dict(envs[setting])


def hold_host_heap() -> bool:
    """Keep freed host memory in this process's heap instead of returning it to the OS (cpu backend).

    Why: glibc serves every allocation over its mmap threshold (128 KB, at most 32 MB) with a fresh
    mmap and unmaps it on free, and trims the heap's top past 128 KB. A CPU training step frees and
    re-allocates its activations every micro-step (tensors of 10-100 MB), so each one comes back as
    untouched pages and its first write page-faults every 4 KB: an elementwise op over such a tensor
    ran 2-3x slower fresh than into a reused buffer, and the medium shared-prompt step ~1.2x slower
    (docs/performance.md). The settings: never mmap (M_MMAP_MAX 0: large blocks come from the heap
    and are reused), trim the heap only past 2 GB free, grow it 64 MB at a time. The cost is the
    one a caching allocator has: resident memory stays at its peak. This is what LD_PRELOAD-ing
    jemalloc / tcmalloc does for PyTorch on CPU (Intel's tuning guide); mallopt needs no extra
    library and no environment set before the process starts. Linux with glibc only (elsewhere a
    no-op); PERIODIC_ASYNC_HOST_MALLOC=system opts out. Returns whether the settings are on."""
    global _HOST_HEAP_HELD
    if _HOST_HEAP_HELD is not None:
        return _HOST_HEAP_HELD
    choice = os.environ.get(HOST_MALLOC_ENV, "hold")
    if choice not in ("hold", "system"):
        raise InputError(f"{HOST_MALLOC_ENV}={choice!r}: allowed hold (the default) or system")
    _HOST_HEAP_HELD = False
    if choice == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):      # a libc without mallopt (musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _HOST_HEAP_HELD = all(mallopt(param, value) == 1 for param, value in _HELD_HEAP.items())
    return _HOST_HEAP_HELD


def setup_cuda() -> None:
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "backend 'cuda' needs a CUDA build of torch and a visible NVIDIA GPU "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); install the CUDA torch "
            "wheel for your driver (pip install torch==<version> --index-url <your CUDA wheel index>) "
            "or run with --backend cpu")


def setup_npu(patch_megatron: bool) -> None:
    # torch_npu registers the 'npu' device; MindSpeed's adaptor patches Megatron-core for Ascend
    # (trainer processes only: backend.py's docstring says why).
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    try:
        import torch_npu  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            f"backend 'npu' needs torch_npu with CANN ({e}); on an Ascend 910B node source "
            "/usr/local/Ascend/ascend-toolkit/set_env.sh and `pip install torch-npu==2.7.1` "
            "(see docs/running-on-910b.md)") from None
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        raise BackendUnavailable("backend 'npu': torch_npu imported but no NPU is visible "
                                 "(check ASCEND_RT_VISIBLE_DEVICES and `npu-smi info`)")
    if not patch_megatron:
        return
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            f"backend 'npu' needs MindSpeed ({e}); install it from source (gitcode Ascend/MindSpeed, "
            "branch matching your Megatron-core; see docs/running-on-910b.md)") from None
