"""The backend layer: names, process-group backends, and one clear line for a missing stack."""
import os
import subprocess
import sys

import pytest
import torch

from periodic_async.backend import BackendUnavailable, get_backend
from periodic_async.backend_setup import HOST_MALLOC_ENV


def test_cpu_backend_and_megatron_shim():
    b = get_backend("cpu")
    assert (b.name, b.dist_backend, b.attention_impl) == ("cpu", "gloo", "sdpa")
    assert b.device() == torch.device("cpu")
    # the shim Megatron-core needs on CPU: current_device() is used as a `device=` argument
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_unavailable_says_what_to_install():
    with pytest.raises(BackendUnavailable) as e:
        get_backend("cuda")
    msg = str(e.value)
    assert "backend 'cuda' needs a CUDA build of torch" in msg and "--backend cpu" in msg
    assert "\n" not in msg


def test_npu_unavailable_says_what_to_install():
    with pytest.raises(BackendUnavailable) as e:
        get_backend("npu")
    msg = str(e.value)
    assert "backend 'npu' needs torch_npu" in msg and "pip install torch-npu" in msg
    assert "\n" not in msg


def test_unknown_backend():
    with pytest.raises(BackendUnavailable, match="allowed: cpu, cuda, npu"):
        get_backend("tpu")
    get_backend("cpu")  # leave the cpu backend active for the other tests


def test_cpu_placement_splits_cores_between_workers_and_trainer(monkeypatch):
    b = get_backend("cpu")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    workers, trainer = b.rollout_placements(num_workers=2, trainer_procs=1)
    assert [w["cores"] for w in workers] == [[4, 5], [2, 3]] and trainer["cores"] == [0, 1]
    workers, trainer = b.rollout_placements(num_workers=0, trainer_procs=1)
    assert workers == [] and trainer["cores"] == [0, 1, 2, 3, 4, 5]
    # fewer cores than processes: shared round-robin, never an empty core list
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    workers, trainer = b.rollout_placements(num_workers=2, trainer_procs=1)
    assert [w["cores"] for w in workers] == [[1], [0]] and trainer["cores"] == [0]


def test_cpu_placement_shares_cores_with_one_seat_per_process(monkeypatch):
    b = get_backend("cpu")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    workers, trainer = b.rollout_placements(num_workers=2, trainer_procs=1, share_cores=True)
    assert trainer["cores"] == [0, 1, 2, 3, 4, 5] and all(w["cores"] == [0, 1, 2, 3, 4, 5] for w in workers)
    seats = [trainer["seat"]] + [w["seat"] for w in workers]
    assert [s.party for s in seats] == [0, 1, 2] and all(s.board is seats[0].board for s in seats)
    # two trainer processes on the node cannot share one board (torchrun starts them): split
    workers, trainer = b.rollout_placements(num_workers=1, trainer_procs=2, share_cores=True)
    assert "seat" not in trainer and workers[0]["cores"] == [3, 4, 5]


def _busy_in_child(seat, started, release):
    seat.set_busy(True)
    started.set()
    release.wait(30)
    seat.set_busy(False)


def test_core_seat_divides_the_cores_among_the_busy_processes_across_processes():
    """Threads = cores // busy parties, read from shared memory that a spawned process writes: a
    stage alone gets every core, two busy stages half each, never 0."""
    import multiprocessing as mp
    from periodic_async.backend import CoreSeat
    before = torch.get_num_threads()
    try:
        board = CoreSeat.new_board(3)
        trainer, worker = CoreSeat(board, 0, 6), CoreSeat(board, 1, 6)
        trainer.set_busy(True)
        assert trainer.threads == torch.get_num_threads() == 6
        ctx = mp.get_context("spawn")
        started, release = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_busy_in_child, args=(worker, started, release))
        child.start()
        assert started.wait(60)
        assert trainer.refresh() == torch.get_num_threads() == 3
        board[2] = 1                           # a third process busy: 6 // 3
        assert trainer.refresh() == 2
        board[2] = 0
        release.set()
        child.join(30)
        assert child.exitcode == 0
        assert trainer.refresh() == 6          # the worker said it is idle again
        assert CoreSeat(CoreSeat.new_board(4), 0, 2).refresh() >= 1
        b4 = CoreSeat.new_board(4)
        for i in range(4):
            b4[i] = 1
        assert CoreSeat(b4, 0, 2).refresh() == 1   # more busy parties than cores: one thread, not 0
    finally:
        torch.set_num_threads(before)


def test_device_placement_needs_enough_devices(monkeypatch):
    from periodic_async.backend import _BACKENDS
    cuda = _BACKENDS["cuda"]          # the placement rule only; no CUDA needed
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    workers, _ = cuda.rollout_placements(num_workers=2, trainer_procs=2)
    # each worker sees only its own device (index 0 inside it): trainer ranks keep devices 0 and 1
    assert [w["device"] for w in workers] == ["cuda:0", "cuda:0"]
    assert [w["env"] for w in workers] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    # the node's own restriction is respected: physical ids, not indices
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    workers, _ = cuda.rollout_placements(num_workers=2, trainer_procs=2)
    assert [w["env"] for w in workers] == [{"CUDA_VISIBLE_DEVICES": "6"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    with pytest.raises(BackendUnavailable, match="2 trainer processes \\+ 3 rollout workers need 5 cuda devices"):
        cuda.rollout_placements(num_workers=3, trainer_procs=2)
    npu = _BACKENDS["npu"]
    monkeypatch.setattr(type(npu), "device_count", lambda self: 8)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    workers, _ = npu.rollout_placements(num_workers=4, trainer_procs=4)
    assert [w["env"] for w in workers] == [{"ASCEND_RT_VISIBLE_DEVICES": str(i)} for i in (4, 5, 6, 7)]
    assert {w["device"] for w in workers} == {"npu:0"}



@pytest.mark.parametrize("name, var", [("cuda", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")])
def test_a_tensor_parallel_worker_sees_its_group_of_devices(monkeypatch, name, var):
    """rollout.tensor_parallel_size 2: each worker holds 2 devices after the trainer's, listed in
    its visible-devices variable (physical ids), and the count check counts workers x 2."""
    from periodic_async.backend import _BACKENDS
    b = _BACKENDS[name]                                   # the placement rule only; no device stack
    monkeypatch.setattr(type(b), "device_count", lambda self: 8)
    monkeypatch.delenv(var, raising=False)
    workers, _ = b.rollout_placements(num_workers=2, trainer_procs=4, devices_per_worker=2)
    assert [w["env"] for w in workers] == [{var: "4,5"}, {var: "6,7"}]
    assert {w["device"] for w in workers} == {f"{name}:0"}     # vLLM's rank 0 device inside the worker
    monkeypatch.setenv(var, "8,9,10,11,12,13,14,15")
    workers, _ = b.rollout_placements(num_workers=1, trainer_procs=2, devices_per_worker=4)
    assert [w["env"] for w in workers] == [{var: "10,11,12,13"}]
    with pytest.raises(BackendUnavailable, match=f"4 trainer processes \\+ 3 rollout workers x 2 devices each "
                                                 f"\\(rollout.tensor_parallel_size\\) need 10 {name} devices on this "
                                                 f"node; 8 visible"):
        b.rollout_placements(num_workers=3, trainer_procs=4, devices_per_worker=2)


def test_a_tensor_parallel_worker_on_a_rollout_node_sees_its_group(monkeypatch):
    from periodic_async.backend import _BACKENDS
    npu = _BACKENDS["npu"]
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert npu.node_worker_placement(1, 4, devices_per_worker=2)["env"] == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "8,9,10,11")
    assert npu.node_worker_placement(1, 2, devices_per_worker=2)["env"] == {"ASCEND_RT_VISIBLE_DEVICES": "10,11"}
    assert npu.node_worker_placement(3, 4)["env"] == {"ASCEND_RT_VISIBLE_DEVICES": "11"}
    with pytest.raises(BackendUnavailable, match="needs 8 visible npu devices"):
        npu.node_worker_placement(2, 4, devices_per_worker=2)


def test_a_cpu_worker_cannot_span_devices():
    with pytest.raises(ValueError, match="devices_per_worker: 2 needs backend cuda or npu"):
        get_backend("cpu").rollout_placements(num_workers=1, trainer_procs=1, devices_per_worker=2)


# The npu set-up in a fresh interpreter with stand-ins on the path: a torch_npu that registers a
# visible `torch.npu`, and a mindspeed whose megatron_adaptor only records that it was imported.
_FAKE_TORCH_NPU = "import torch, types\ntorch.npu = types.SimpleNamespace(is_available=lambda: True)\n"


def _npu_setup_in_subprocess(tmp_path, body: str) -> str:
    import os
    import subprocess
    import sys
    import textwrap
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(_FAKE_TORCH_NPU)
    (tmp_path / "mindspeed").mkdir()
    (tmp_path / "mindspeed" / "__init__.py").write_text("")
    (tmp_path / "mindspeed" / "megatron_adaptor.py").write_text("")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), repo, os.environ.get("PYTHONPATH")) if p))
    script = "import sys\nfrom periodic_async.backend import get_backend\n" + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_npu_rollout_role_imports_torch_npu_but_not_mindspeed(tmp_path):
    """A rollout worker runs only vLLM: MindSpeed's adaptor (which no-ops torch.compile, fakes
    transformer_engine / flash_attn / apex and parses sys.argv) must not be imported there, also
    not by the worker's later role-less calls (weight_sync)."""
    _npu_setup_in_subprocess(tmp_path, """
        b = get_backend("npu", role="rollout")
        assert b.name == "npu" and "torch_npu" in sys.modules
        assert "mindspeed.megatron_adaptor" not in sys.modules
        get_backend("npu")                              # what weight_sync calls in the worker
        assert "mindspeed.megatron_adaptor" not in sys.modules
        assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)
    """)


def test_npu_trainer_role_imports_mindspeeds_adaptor(tmp_path):
    _npu_setup_in_subprocess(tmp_path, """
        get_backend("npu")                              # the trainer's call: role defaults to trainer
        assert "mindspeed.megatron_adaptor" in sys.modules
        try:
            get_backend("npu", role="rollout")          # too late: the patches cannot be undone
        except RuntimeError as e:
            assert "already imported mindspeed.megatron_adaptor" in str(e)
        else:
            raise AssertionError("rollout role accepted after the trainer set-up")
    """)


def test_cpu_rollout_role_redirects_cuda_calls_without_importing_megatron(tmp_path):
    """A CPU rollout worker gets torch's CUDA redirects but not Megatron-core (~3 s of every
    worker's start, also through its later role-less calls); a trainer gets both, in that order
    too (a process that ran a rollout engine first, then trains)."""
    _npu_setup_in_subprocess(tmp_path, """
        import torch
        get_backend("cpu", role="rollout")
        get_backend("cpu")                              # what weight_sync calls in the worker
        assert str(torch.cuda.current_device()) == "cpu"
        assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)
        get_backend("cpu", role="trainer")
        from megatron.core.pipeline_parallel import schedules
        assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    """)


def test_unknown_role():
    with pytest.raises(ValueError, match="allowed trainer, rollout"):
        get_backend("cpu", role="evaluator")
    get_backend("cpu")


def test_reinitialising_model_parallel_does_not_leak_process_groups(dist_cpu):
    """Every in-process test and tool re-initialises Megatron's groups; each set holds gloo threads
    that poll. Without destroying the previous set, a long test session accumulated ~3000 threads
    and spent about a core on them."""
    import os
    from torch.distributed import distributed_c10d
    dist_cpu.init_model_parallel(1, 1, seed=0)
    groups, threads = len(distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))
    for _ in range(3):
        dist_cpu.init_model_parallel(1, 1, seed=0)
    assert len(distributed_c10d._world.pg_map) == groups
    assert len(os.listdir("/proc/self/task")) <= threads + 2


def test_megatron_fallback_warnings_are_filtered_by_message_only():
    """Megatron-core's 'Transformer Engine and Apex are not installed. Falling back to ...' import
    warnings are dropped (every process that imports it printed four); any other warning shows."""
    import warnings
    from periodic_async.backend_setup import megatron_fallback_note, quiet_megatron_fallbacks
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_megatron_fallbacks()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to local implementations "
                      "of multi_tensor_applier and multi_tensor_scale")
        warnings.warn("full scope is deprecated.")
    assert [str(w.message) for w in seen] == ["full scope is deprecated."]
    note = megatron_fallback_note()
    assert note is None or "not installed" in note


_HEAP_PROBE = r"""
import resource, sys
import torch
from periodic_async.backend import get_backend
get_backend("cpu", role=sys.argv[1])
def faults_of_a_step():   # a micro-step's pattern: fresh activations, written, all freed at the end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    acts = [torch.empty(10 << 20).fill_(1.0) for _ in range(4)]     # 4 x 40 MB
    acts.append(acts[0] * acts[1])
    del acts
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(max([faults_of_a_step() for _ in range(8)][-3:]))     # the first steps grow the heap either way
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_cpu_backend_reuses_freed_host_memory_without_page_faults(role):
    """The cpu backend keeps freed host memory in the heap (backend_setup.hold_host_heap), so a
    training step's activations, freed and allocated again every micro-step, land on pages already
    mapped. Counted in minor page faults, not time: once the heap has grown, a step of five 40 MB
    tensors faults on almost none of their 51,200 pages; with glibc's defaults (the opt-out: the
    control that shows the probe can fail; blocks over 32 MB are always mapped afresh there) on
    most of them."""
    def faults(env_extra):
        env = {**os.environ, **env_extra}
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, role], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.strip().splitlines()[-1])
    pages = 5 * (40 << 20) // 4096
    held, system = faults({}), faults({HOST_MALLOC_ENV: "system"})
    assert held < pages // 10, (held, pages)
    assert system > pages // 2, (system, pages)


def test_a_misspelt_host_malloc_choice_is_refused(monkeypatch):
    """PERIODIC_ASYNC_HOST_MALLOC takes hold or system; a typo must not silently mean hold."""
    import periodic_async.backend_setup as setup
    monkeypatch.setattr(setup, "_HOST_HEAP_HELD", None)
    monkeypatch.setenv(HOST_MALLOC_ENV, "sytem")
    with pytest.raises(ValueError, match="PERIODIC_ASYNC_HOST_MALLOC='sytem': allowed hold"):
        setup.hold_host_heap()
