"""THE device layer: every device-specific line of the project lives here and in
backend_setup.py (the device stack's set-up, applied once per process by `get_backend`: the CPU
shims for Megatron-core, the CUDA check, torch_npu and MindSpeed's adaptor).

A `Backend` is chosen by name (`cpu`, `cuda`, `npu`) and owns:
- the torch device and the process-group backend (gloo / nccl / hccl),
- Megatron-core's model-parallel groups and RNG tracker,
- the attention implementation name used by the shared-prompt kernels,
- where trainer ranks and rollout workers run (placements, a worker's visible devices),
- host buffers (pinned on accelerators) and the stateless pair groups of the weight sync.

Asking for `npu` or `cuda` where it is not available raises `BackendUnavailable` with one line
saying what is missing and how to install it.

A process asks for its role with the backend: `trainer` (Megatron runs here) or `rollout` (only an
inference engine runs here). On npu a rollout process gets torch_npu alone, never MindSpeed's
adaptor: that import turns torch.compile / torch.jit.script into no-ops, puts fake
transformer_engine / flash_attn / apex modules in sys.modules, wraps Tensor methods and
dist.all_reduce and parses sys.argv - none of which belongs in a vLLM process.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .backend_setup import BackendUnavailable, apply_cpu_megatron_shims, hold_host_heap, setup_cuda, setup_npu

_SPAWN_ENV_LOCK = threading.Lock()


@dataclass(frozen=True)
class Backend:
    name: str                 # cpu | cuda | npu
    dist_backend: str         # gloo | nccl | hccl
    attention_impl: str       # sdpa (cpu) | flex (cuda) | npu_fusion (npu)

    # ------------------------------------------------------------------ device
    def device(self, local_rank: int = 0) -> torch.device:
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, local_rank)

    def current_device(self) -> torch.device:
        """The device this process computes on (after set_device / enter_placement)."""
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, getattr(torch, self.name).current_device())

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor for device copies: pinned on accelerators (async, DMA-able)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.name != "cpu")

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)
        elif self.name == "npu":
            torch.npu.set_device(local_rank)  # type: ignore[attr-defined]

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU and device generators plus Megatron's model-parallel RNG tracker."""
        torch.manual_seed(seed)
        if self.name == "cuda":
            torch.cuda.manual_seed_all(seed)
        elif self.name == "npu":
            torch.npu.manual_seed_all(seed)  # type: ignore[attr-defined]
        from megatron.core.tensor_parallel import random as mpu_random
        if self.name == "cpu":
            # The tracker's states are CUDA generators; the inference tracker only records seeds.
            mpu_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        else:
            mpu_random.model_parallel_cuda_manual_seed(seed)

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()
        elif self.name == "npu":
            torch.npu.synchronize()  # type: ignore[attr-defined]

    def max_memory_allocated(self) -> int:
        """Peak device memory in bytes (0 on CPU, where the allocator does not track it)."""
        if self.name == "cuda":
            return torch.cuda.max_memory_allocated()
        if self.name == "npu":
            return torch.npu.max_memory_allocated()  # type: ignore[attr-defined]
        return 0

    def device_memory_bytes(self, index: int = 0) -> int | None:
        """Total memory in bytes of this process's device `index` (the memory plan's limit); None on
        cpu, where trainer and workers share the host's RAM and no device limit is checked."""
        if self.name == "cuda":
            return torch.cuda.get_device_properties(index).total_memory
        if self.name == "npu":
            return torch.npu.get_device_properties(index).total_memory  # type: ignore[attr-defined]
        return None

    def reset_peak_memory(self) -> None:
        if self.name == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.name == "npu":
            torch.npu.reset_peak_memory_stats()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ placement
    def rollout_placements(self, num_workers: int, trainer_procs: int,
                           share_cores: bool = False, devices_per_worker: int = 1) -> tuple[list[dict], dict]:
        """Where each rollout worker and the trainer processes of this node run.

        cpu: with `share_cores` (and one trainer process), every process may use every core and
        a `CoreSeat` in each placement ("seat") sets its thread count to the cores divided by the
        processes busy at that moment: a stage running alone gets all the cores, stages that
        overlap split them. Otherwise the cores are split - each worker gets an equal share and
        the trainer the rest (at least one core each).
        cuda/npu: trainer local ranks use devices 0..trainer_procs-1, workers `devices_per_worker`
        each of the next ones (a vLLM engine with tensor parallelism spans that many), made the
        only devices the worker sees (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, e.g. "4,5",
        set when it is spawned).
        Returns ([worker placement], trainer placement); a placement is {"device", "cores"} and,
        for a worker on an accelerator, "env"."""
        _check_devices_per_worker(self.name, devices_per_worker)
        if self.name == "cpu":
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
            if num_workers == 0:
                return [], {"device": "cpu", "cores": cores}
            if share_cores and trainer_procs == 1:
                busy = CoreSeat.new_board(1 + num_workers)
                seats = [CoreSeat(busy, party, len(cores)) for party in range(1 + num_workers)]
                workers = [{"device": "cpu", "cores": cores, "seat": seats[1 + w]} for w in range(num_workers)]
                return workers, {"device": "cpu", "cores": cores, "seat": seats[0]}
            if len(cores) < num_workers + 1:
                # Oversubscribed (e.g. tests with 2 workers on 2 cores): workers share cores round-robin.
                import logging
                logging.getLogger(__name__).warning(
                    "%d rollout workers + the trainer on %d CPU cores: processes will share cores",
                    num_workers, len(cores))
                workers = [{"device": "cpu", "cores": [cores[(w + 1) % len(cores)]]} for w in range(num_workers)]
                return workers, {"device": "cpu", "cores": [cores[0]]}
            per_worker = max(1, len(cores) // (num_workers + 1))
            workers = [{"device": "cpu", "cores": cores[len(cores) - (w + 1) * per_worker:len(cores) - w * per_worker]}
                       for w in range(num_workers)]
            return workers, {"device": "cpu", "cores": cores[:len(cores) - num_workers * per_worker]}
        count = self.device_count()
        need = trainer_procs + num_workers * devices_per_worker
        if need > count:
            each = f" x {devices_per_worker} devices each (rollout.tensor_parallel_size)" if devices_per_worker > 1 else ""
            raise BackendUnavailable(f"{trainer_procs} trainer processes + {num_workers} rollout workers{each} need "
                                     f"{need} {self.name} devices on this node; {count} visible")
        # A worker sees only its own devices (set before torch or vLLM start in it), so vLLM, which
        # takes the first visible ones, cannot land on the trainer's; inside they are 0..tp-1.
        visible = self.visible_devices()
        workers = []
        for w in range(num_workers):
            first = trainer_procs + w * devices_per_worker
            workers.append({"device": f"{self.name}:0", "cores": None,
                            "env": {self.visible_devices_var: ",".join(visible[first:first + devices_per_worker])}})
        return workers, {"device": None, "cores": None}

    def node_worker_placement(self, local_rank: int, local_world: int, devices_per_worker: int = 1) -> dict:
        """The placement of rollout worker `local_rank` of `local_world` on a rollout-only node
        (rollout/remote.py): on cpu an equal share of the node's cores, on accelerators the
        `local_rank`-th group of `devices_per_worker` visible devices as the only ones the worker
        sees. Needs no device stack."""
        _check_devices_per_worker(self.name, devices_per_worker)
        if self.name == "cpu":
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
            per = max(1, len(cores) // local_world)
            mine = cores[local_rank * per:(local_rank + 1) * per] or [cores[local_rank % len(cores)]]
            return {"device": "cpu", "cores": mine}
        ids = [i.strip() for i in os.environ.get(self.visible_devices_var, "").split(",") if i.strip()]
        first = local_rank * devices_per_worker
        mine = range(first, first + devices_per_worker)
        if ids and mine.stop > len(ids):
            raise BackendUnavailable(f"rollout worker {local_rank} of {local_world} x {devices_per_worker} devices "
                                     f"needs {local_world * devices_per_worker} visible {self.name} devices; "
                                     f"{self.visible_devices_var}={','.join(ids)}")
        physical = ",".join(ids[i] if ids else str(i) for i in mine)
        return {"device": f"{self.name}:0", "cores": None, "env": {self.visible_devices_var: physical}}

    @property
    def visible_devices_var(self) -> str | None:
        """The environment variable that limits which devices a process sees."""
        return {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}.get(self.name)

    def device_count(self) -> int:
        if self.name == "cpu":
            return 1
        return getattr(torch, self.name).device_count()

    def visible_devices(self) -> list[str]:
        """The physical ids of this process's devices, in index order (the variable's list when set)."""
        ids = os.environ.get(self.visible_devices_var or "", "")
        ids = [i.strip() for i in ids.split(",") if i.strip()]
        return ids if ids else [str(i) for i in range(self.device_count())]

    def enter_placement(self, placement: dict, processes_sharing: int = 1) -> torch.device:
        """Apply a placement to the calling process (core affinity + thread count, or the device);
        `processes_sharing` processes (e.g. trainer ranks of one node) split the cores' threads.
        A placement's "env" (the visible devices) must be in the process's environment before torch
        starts: `spawn_env` gives it to a process being spawned."""
        cores = placement.get("cores")
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(max(1, len(cores) // processes_sharing))
            if placement.get("seat") is not None:
                placement["seat"].set_busy(False)   # a restarted worker's predecessor may have died busy
        device = placement.get("device")
        if device and device != "cpu":
            dev = torch.device(device)
            self.set_device(dev.index or 0)
            return dev
        return torch.device("cpu")

    def trainer_device(self, placement: dict, local_rank: int, local_world: int) -> torch.device:
        """The device of a trainer rank: on cpu the node's trainer cores (shared by its
        `local_world` ranks), on accelerators the device of its local rank."""
        if self.name == "cpu":
            return self.enter_placement(placement, local_world)
        return self.device(local_rank)

    @staticmethod
    @contextlib.contextmanager
    def spawn_env(placement: dict):
        """The placement's environment variables set while a child process is spawned (it inherits
        them at exec, before it imports anything); the parent's are restored afterwards."""
        env = placement.get("env") or {}
        with _SPAWN_ENV_LOCK:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                yield
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

    # ------------------------------------------------------------------ distributed
    def init_distributed(self) -> tuple[int, int, int]:
        """Join (or create) the default process group. Returns (rank, world_size, local_rank).

        Under torchrun the env:// rendezvous is used; a plain `python -m periodic_async` makes a
        single-process group on a free loopback port, because Megatron-core needs one.
        """
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.set_device(local_rank)
            dist.init_process_group(self.dist_backend, rank=rank, world_size=world)
            return rank, world, local_rank
        self.set_device(0)
        dist.init_process_group(self.dist_backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
        return 0, 1, 0

    def init_model_parallel(self, tp: int, pp: int, seed: int) -> None:
        """Megatron-core parallel groups (TP x PP x DP over the default group) and RNG."""
        from megatron.core import parallel_state
        from torch.distributed import distributed_c10d
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # Megatron's destroy only drops its references: the process groups stay registered, each
        # with gloo threads that poll (~50 threads per initialisation on CPU). A process that
        # re-initialises (in-process tests, tools) destroys the ones the previous call made.
        for group in _MEGATRON_GROUPS:
            if group in distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
        before = set(distributed_c10d._world.pg_map)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        _MEGATRON_GROUPS[:] = [g for g in distributed_c10d._world.pg_map if g not in before]
        self.manual_seed(seed)


    @staticmethod
    def shutdown_distributed() -> None:
        """Leave the process groups at the end of a process (torchrun waits for every rank).

        torch < 2.8 destroys a gloo group holding the GIL while it joins the group's threads
        (pytorch PR #154976 releases it); a thread still freeing a just-finished collective whose
        tensors Python already dropped (all_gather_object's) waits for that GIL: destroy right after
        such a collective deadlocked ~1 run in 10 on torch 2.7.1, the Ascend stack's. So: a barrier,
        then a sleep (it releases the GIL) for the threads to finish before the destroy."""
        if not dist.is_initialized():
            return
        dist.barrier()
        if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 8):
            import time
            time.sleep(0.2)
        dist.destroy_process_group()

    def pair_group(self, store: "dist.Store", rank: int, size: int, timeout_s: float):
        """A process group of `size` members on `store` alone (never the default group, so it
        touches neither Megatron's groups nor vLLM's): gloo / NCCL / HCCL by device."""
        timeout = timedelta(seconds=timeout_s)
        if self.name == "cpu":
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        if self.name == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        import torch_npu  # noqa: F401
        return torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, size, timeout)  # type: ignore[attr-defined]


_MEGATRON_GROUPS: list = []      # the process groups of the last initialize_model_parallel


def _check_devices_per_worker(backend: str, devices_per_worker: int) -> None:
    """A rollout worker spans several devices only on accelerators: on cpu its 'device' is a share
    of the cores (config validation refuses rollout.tensor_parallel_size > 1 there)."""
    if isinstance(devices_per_worker, bool) or not isinstance(devices_per_worker, int) or devices_per_worker < 1:
        raise ValueError(f"devices_per_worker: must be an integer >= 1, got {devices_per_worker!r}")
    if backend == "cpu" and devices_per_worker != 1:
        raise ValueError(f"devices_per_worker: {devices_per_worker} needs backend cuda or npu (a cpu worker's "
                         "placement is a share of the cores)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_BACKENDS = {
    "cpu": Backend("cpu", "gloo", attention_impl="sdpa"),
    "cuda": Backend("cuda", "nccl", attention_impl="flex"),
    "npu": Backend("npu", "hccl", attention_impl="npu_fusion"),
}

_ACTIVE: Optional[Backend] = None
ROLES = ("trainer", "rollout")
_ROLE: Optional[str] = None


def get_backend(name: str, role: str | None = None) -> Backend:
    """Check the device stack for `name`, apply its set-up once, and return the Backend.

    `role`: "trainer" (Megatron runs in this process) or "rollout" (only an inference engine: on
    npu no MindSpeed adaptor). None keeps the role this process already took, "trainer" if none,
    so a rollout worker names its role once, first, and later calls (weight_sync) keep it. The cpu
    backend redirects torch's CUDA calls to the CPU for both roles and patches Megatron-core's
    modules for the trainer only (a rollout worker never imports Megatron-core), and keeps freed
    host memory in the process's heap (backend_setup.hold_host_heap: no page faults on every
    micro-step's fresh activations)."""
    global _ACTIVE, _ROLE
    if name not in _BACKENDS:
        raise BackendUnavailable(f"backend '{name}' is unknown; allowed: {', '.join(_BACKENDS)}")
    if role is None:
        role = _ROLE or "trainer"
    elif role not in ROLES:
        raise ValueError(f"backend role {role!r}: allowed {', '.join(ROLES)}")
    if name == "npu" and role == "rollout" and "mindspeed.megatron_adaptor" in sys.modules:
        # its patches cannot be undone: the rollout process must name its role before anything
        # sets the backend up as a trainer
        raise RuntimeError("get_backend('npu', role='rollout') in a process that already imported "
                           "mindspeed.megatron_adaptor (a trainer set-up)")
    if name == "cpu":
        apply_cpu_megatron_shims(megatron=role == "trainer")
        hold_host_heap()
    elif name == "cuda":
        setup_cuda()
    else:
        setup_npu(patch_megatron=role == "trainer")
    _ACTIVE = _BACKENDS[name]
    _ROLE = role
    return _ACTIVE


def active_backend() -> Backend:
    """The backend chosen by `get_backend` (cpu when none was chosen yet)."""
    return _ACTIVE if _ACTIVE is not None else get_backend("cpu")


def backend_without_setup(name: str) -> Backend:
    """The Backend `name` without its device stack set up: for placement arithmetic in a process
    that only spawns workers (rollout/remote.py), which must not import torch_npu / MindSpeed."""
    if name not in _BACKENDS:
        raise BackendUnavailable(f"backend '{name}' is unknown; allowed: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]


@dataclass
class CoreSeat:
    """One process's seat at a CPU node whose cores its processes share (`rollout_placements`
    with share_cores): the trainer (party 0) and its rollout workers. A process says when it
    starts and stops computing; while busy it runs `cores // (parties busy now)` threads,
    re-read at each `refresh()` (a worker's engine step, a trainer's micro-step), so a stage
    alone gets every core and overlapping stages split them instead of oversubscribing.
    Only thread counts change: on-policy order and results are the placement's business, not
    this one's. The board is shared memory, handed to a worker when it is spawned."""
    board: object         # multiprocessing RawArray of 0/1, one per party
    party: int
    cores: int
    threads: int = 0      # this process's current torch thread count (0: not set yet)

    @staticmethod
    def new_board(parties: int):
        import multiprocessing as mp
        return mp.get_context("spawn").RawArray("b", parties)

    def busy_parties(self) -> int:
        return sum(self.board[i] for i in range(len(self.board)))

    def set_busy(self, busy: bool) -> None:
        self.board[self.party] = 1 if busy else 0
        if busy:
            self.refresh()

    def refresh(self) -> int:
        """Match this process's thread count to the parties busy now; returns it."""
        n = max(1, self.cores // max(1, self.busy_parties()))
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
        return n

    def __getstate__(self):
        return {"board": self.board, "party": self.party, "cores": self.cores, "threads": 0}
