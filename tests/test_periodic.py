"""Periodic asynchrony, end to end with real rollout worker processes.

The central promise: `periodic` (groups consumed in completion order while the rest generate,
weights synced at batch boundaries) gives the same per-step losses and the same parameters as
synchronous training, up to floating-point summation order - also when results arrive shuffled
and when a worker is killed mid-batch.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from periodic_async.config import load_config
from periodic_async.telemetry.logger import read_metrics
from periodic_async.train.trainer import Trainer

from helpers import kill_worker_hook, mixed_k_hook

STEPS = 3
LOSS_KEYS = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"]


def _cfg(run_dir, mode, *extra):
    return load_config("configs/default.yaml", [
        f"trainer.run_dir={run_dir}", f"trainer.mode={mode}", f"trainer.total_steps={STEPS}",
        "trainer.progress_bar=false", "trainer.save_final=false", "data.train_batch_size=8", "rollout.n=4",
        "rollout.max_new_tokens=4", "actor.micro_batch_size=6", "actor.kl_coef=0.1", "actor.entropy_coef=0.01",
        "reward.num_workers=0", "actor.adam_eps=1e-4", *extra])


def _run(run_dir, mode, *extra, hook=None):
    trainer = Trainer(_cfg(run_dir, mode, *extra))
    if hook:
        hook(trainer)
    history = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    return trainer, history, params


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    pools = []
    _, history, params = _run(tmp_path_factory.mktemp("sync"), "sync", hook=lambda t: pools.append(t.producer.pool))
    # the colocated engine's steps ran on the trainer's own thread, not on the producer's (one
    # OpenMP team in the process: rollout/colocated.py)
    assert [p.engine_threads for p in pools] == [{"MainThread"}]
    return history, params


def _assert_same_training(history, params, ref_history, ref_params):
    assert len(history) == len(ref_history) == STEPS
    for step, (h, r) in enumerate(zip(history, ref_history), 1):
        for k in LOSS_KEYS:
            assert h[k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), f"step {step} {k}: {h[k]} vs {r[k]}"
    assert params.keys() == ref_params.keys()
    # Summation order differs (micro-batches are formed in completion order). Adam's update
    # m / (sqrt(v) + eps) is ill-conditioned unless |g| >> eps: with eps = 1e-8 a gradient
    # element of 1e-7 (cancellation) carrying 2e-8 of rounding noise moves its parameter by up to
    # 0.2 lr. These runs use adam_eps = 1e-4 (see _cfg), where that noise stays below 1e-6.
    for n in params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    # and training did move the policy (the comparison is not vacuous)
    assert history[-1]["actor/kl_loss"] > 0


def test_periodic_with_shuffled_arrival_equals_sync(sync_run, tmp_path):
    arrivals = []

    def hook(trainer):
        producer = trainer.producer
        batch_done = producer.batch_done

        def recording_batch_done(step):
            stats, metrics = batch_done(step)
            arrivals.append([r.group_index for r in stats.results])
            return stats, metrics
        producer.batch_done = recording_batch_done

    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=2", "rollout.max_slots=5",
                                    "rollout.arrival_jitter_s=0.01", hook=hook)
    _assert_same_training(history, params, *sync_run)
    # results really arrived out of group order, from both workers
    assert any(order != sorted(order) for order in arrivals)
    assert all(h["training/off_policy/trajectory_staleness/mean"] == 0.0 for h in history)
    assert all(h["trainer/idle_ratio"] < 1 and 0 <= h["rollouter/idle_ratio"] <= 1 for h in history)


def test_sync_split_equals_sync(sync_run, tmp_path):
    _, history, params = _run(tmp_path, "sync_split", "rollout.num_workers=1", "rollout.cpu_cores=split")
    _assert_same_training(history, params, *sync_run)


def test_worker_killed_mid_batch_is_restarted_and_nothing_is_lost(sync_run, tmp_path):
    killed = {}
    hook = kill_worker_hook(killed, at_version=1, worker=0)   # step 2
    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=2", "rollout.max_slots=3",
                                    "rollout.arrival_jitter_s=0.02", "rollout.worker_timeout_s=30", hook=hook)
    assert killed, "the hook never ran"
    _assert_same_training(history, params, *sync_run)
    # one restart: the replacement, started while the batch's producer thread ran, outlives that
    # thread (PR_SET_PDEATHSIG fires on the parent thread's exit) and takes the next weight update
    assert history[1]["rollouter/restarts"] == history[-1]["rollouter/restarts"] == 1
    assert not _alive(killed["pid"])


def test_trainer_refuses_a_sample_from_another_policy_version(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "periodic", "rollout.num_workers=1"))
    try:
        trainer.version = 5           # as if the workers had missed a weight sync
        with pytest.raises(RuntimeError, match="generated by policy version 0, but the trainer is at version 5"):
            trainer.step(1)
    finally:
        trainer.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:        # a zombie is dead too
        return f.read().split()[2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")[:200]
    except OSError:
        return "?"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_run_stops_every_worker(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "periodic_async", "--config", "configs/default.yaml",
                             f"trainer.run_dir={run_dir}", "trainer.total_steps=100000", "trainer.progress_bar=false",
                             "rollout.num_workers=1", "reward.num_workers=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and read_metrics(str(run_dir)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        children = _children(proc.pid)
        assert len(children) >= 2            # a rollout worker and a reward worker at least
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "interrupted: rollout workers and reward processes stopped" in out
        # helpers such as multiprocessing's resource tracker exit once the parent's pipe closes
        deadline = time.time() + 15
        while time.time() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.2)
        for pid in children:
            assert not _alive(pid), f"orphan process {pid} ({_cmdline(pid)}) after {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_periodic_with_shared_prompt_equals_unshared_sync(sync_run, tmp_path):
    """Shared-prompt packing composes with periodic asynchrony: same training as unshared sync.
    The worker and the trainer share the cores (rollout.cpu_cores: shared, the default): each
    batch's last micro-step, which starts once generation is over, runs on every core, and the
    trainer is marked idle from its weight sync on."""
    threads = []    # per batch: the torch thread count at each micro-step
    flags = []      # the trainer's busy flag when it asks for each batch

    def hook(trainer):
        forward_backward = trainer.actor.forward_backward
        batch = trainer.producer.batch

        def asking(step):
            flags.append(trainer.core_seat.board[trainer.core_seat.party])
            return batch(step)
        trainer.producer.batch = asking

        def recording(stream, n, **kw):
            mine = []
            threads.append(mine)

            def tap():
                for mb in stream:
                    mine.append(torch.get_num_threads())
                    yield mb
            return forward_backward(tap() if not kw.get("use_old") else stream, n, **kw)
        trainer.actor.forward_backward = recording

    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=1", "actor.shared_prompt=true",
                                    hook=hook)
    _assert_same_training(history, params, *sync_run)
    cores = len(os.sched_getaffinity(0))
    assert trainer.core_seat is not None and len(threads) == STEPS
    # after its weights went out the trainer is idle, before the next batch's groups: the worker's
    # first engine step of a batch (the prefill) gets every core
    assert flags == [0] * STEPS, flags
    if cores >= 2:
        assert [batch[-1] for batch in threads] == [cores] * STEPS, threads
        assert all(1 <= t <= cores for batch in threads for t in batch), threads


def test_broadcast_weight_sync_with_a_killed_worker_equals_sync(sync_run, tmp_path):
    """rollout.weight_sync=broadcast (a process group per worker, small buckets: the cross-node
    path, here on one node over gloo): same training as sync, also when a worker is SIGKILLed
    mid-batch (its replacement pairs with the pool and receives the current weights)."""
    killed = {}
    kill = kill_worker_hook(killed, at_version=2, worker=1)   # step 3: the replacement needs version 2

    def hook(trainer):
        assert trainer.producer.pool._sync_address      # the broadcast path is the one in use
        kill(trainer)

    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=2", "rollout.max_slots=3",
                                    "rollout.weight_sync=broadcast", "actor.export_bucket_mb=0.01",
                                    "rollout.arrival_jitter_s=0.02", "rollout.worker_timeout_s=30", hook=hook)
    assert killed, "the hook never ran"
    _assert_same_training(history, params, *sync_run)
    assert history[2]["rollouter/restarts"] == 1


# ---------------------------------------------------------------------- K per group

MIXED_K = (2, 4, 8)


@pytest.fixture(scope="module")
def mixed_k_sync_run(tmp_path_factory):
    """Sync, unshared, groups of K = 2, 4, 8 in every batch: the reference of the tests below."""
    _, history, params = _run(tmp_path_factory.mktemp("sync_mixed"), "sync", hook=mixed_k_hook(MIXED_K))
    return history, params


@pytest.mark.parametrize("mode,shared", [("periodic", False), ("periodic", True), ("sync", True)])
def test_groups_of_different_size_train_and_periodic_equals_sync(mixed_k_sync_run, tmp_path, mode, shared):
    """A batch whose groups have K = 2, 4 and 8 trains in periodic and sync mode, with and without
    shared-prompt attention, and every variant equals unshared sync: nothing assumes rollout.n.
    (micro_batch_size 6 cuts groups of 8 across micro-batches; completion order differs.)"""
    history, params = mixed_k_sync_run
    sizes = [MIXED_K[i % 3] for i in range(8)]
    assert all(h["rollout/group_size/mean"] == pytest.approx(sum(sizes) / 8) for h in history)
    extra = ["rollout.num_workers=2", "rollout.max_slots=5", "rollout.arrival_jitter_s=0.01"] if mode == "periodic" else []
    _, got, got_params = _run(tmp_path, mode, *extra, f"actor.shared_prompt={str(shared).lower()}",
                              hook=mixed_k_hook(MIXED_K))
    _assert_same_training(got, got_params, history, params)
    assert all(h["rollout/group_size/mean"] == pytest.approx(sum(sizes) / 8) for h in got)
    assert all(h["perf/total_num_tokens"] == r["perf/total_num_tokens"] for h, r in zip(got, history))


# ---------------------------------------------------------------------- rollout workers on other nodes

ROLLOUT_KEY = "test-rollout-key"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_rollout_node(port: int, log_path, nproc: int = 2) -> subprocess.Popen:
    """A second launch on this machine standing in for a rollout node: torchrun with one relay
    per 'device' (rollout/remote.py), in its own session so the test can kill the whole node."""
    env = {**os.environ, "PERIODIC_ASYNC_ROLLOUT_KEY": ROLLOUT_KEY}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "--max-restarts", "0", "-m", "periodic_async.rollout.remote", "--connect", f"127.0.0.1:{port}"],
        env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def test_rollout_node_killed_mid_batch_equals_sync(sync_run, tmp_path, monkeypatch):
    """Trainer and rollout workers as two launches on one machine (the trainer with no local
    workers, a 'rollout node' of two relays connecting over TCP): the same training as sync, also
    when the whole rollout node is SIGKILLed mid-batch and a new node joins - the samples the lost
    workers owed are generated again by the new ones, nothing is lost or counted twice."""
    monkeypatch.setenv("PERIODIC_ASYNC_ROLLOUT_KEY", ROLLOUT_KEY)
    port = _free_port()
    nodes = [_start_rollout_node(port, tmp_path / "node0.log")]
    state = {}

    def hook(trainer):
        pool = trainer.producer.pool
        assert pool.pids() == [] and pool.num_workers == 2        # every worker is on the "other node"
        score = trainer.producer.scorer.rewards

        def killing_score(groups, stats):
            if trainer.version == 1 and not state:
                state["owed"] = len(pool._owner)                       # samples still being generated
                os.killpg(nodes[0].pid, signal.SIGKILL)
                nodes.append(_start_rollout_node(port, tmp_path / "node1.log"))
            return score(groups, stats)
        trainer.producer.scorer.rewards = killing_score

    try:
        trainer, history, params = _run(
            tmp_path / "run", "periodic", "rollout.num_workers=0", "rollout.remote_workers=2",
            f"rollout.remote_address=127.0.0.1:{port}", "rollout.weight_sync=broadcast", "rollout.max_slots=3",
            "rollout.arrival_jitter_s=0.02", "rollout.worker_timeout_s=30", hook=hook)
        trainer.close()
        assert state and state["owed"] > 0, f"the node was not killed mid-batch: {state}"
        _assert_same_training(history, params, *sync_run)
        assert nodes[1].wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]   # stopped cleanly
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=30)
    log0 = (tmp_path / "node0.log").read_text()
    assert nodes[0].returncode == -signal.SIGKILL, log0[-3000:]


def test_async_with_workers_on_a_rollout_node_keeps_the_bound(tmp_path, monkeypatch):
    """trainer.mode async (eta 2) with every worker on a 'rollout node' (two relays over TCP, the
    broadcast sync): versions are published without waiting, generation runs ahead and no sample
    is older than the bound; the node stops cleanly with the pool (an update in flight at the end
    is finished first: its workers wait for the pool's send)."""
    monkeypatch.setenv("PERIODIC_ASYNC_ROLLOUT_KEY", ROLLOUT_KEY)
    port = _free_port()
    node = _start_rollout_node(port, tmp_path / "node.log")
    try:
        trainer, history, _ = _run(
            tmp_path / "run", "async", "trainer.max_staleness=2", "actor.policy_loss=decoupled_ppo",
            "rollout.num_workers=0", "rollout.remote_workers=2", f"rollout.remote_address=127.0.0.1:{port}",
            "rollout.weight_sync=broadcast", "rollout.max_slots=3", "rollout.arrival_jitter_s=0.01")
        trainer.close()
        assert len(history) == STEPS and all(h["rollout/generated"] == 32 for h in history)
        stale = [h["training/off_policy/trajectory_staleness/max"] for h in history]
        assert max(stale) <= 2 and max(stale) > 0, stale
        assert node.wait(timeout=60) == 0, (tmp_path / "node.log").read_text()[-3000:]
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=30)


def test_rollout_relays_need_the_key_and_the_pool_names_the_command(tmp_path, monkeypatch):
    from multiprocessing.connection import Listener

    from periodic_async.rollout import remote
    from periodic_async.rollout.worker import WorkerError, WorkerPool, WorkerSettings

    monkeypatch.delenv("PERIODIC_ASYNC_ROLLOUT_KEY", raising=False)
    with pytest.raises(RuntimeError, match="set PERIODIC_ASYNC_ROLLOUT_KEY"):
        remote.rollout_key()
    with Listener(("127.0.0.1", 0), authkey=b"right") as listener:
        import threading
        threading.Thread(target=lambda: _accept_quietly(listener), daemon=True).start()
        with pytest.raises(RuntimeError, match="refused this relay's key"):
            remote.connect("%s:%d" % listener.address, b"wrong", timeout_s=5)
    with pytest.raises(RuntimeError, match="no rollout pool at 127.0.0.1"):
        remote.connect(f"127.0.0.1:{_free_port()}", b"k", timeout_s=0.5)

    monkeypatch.setenv("PERIODIC_ASYNC_ROLLOUT_KEY", ROLLOUT_KEY)
    settings = WorkerSettings("cpu", str(tmp_path), 0, 1, 4, weight_sync="broadcast")
    with pytest.raises(WorkerError, match=r"1 of them on other nodes: start them with `torchrun .* --connect 127\.0\.0\.1:"):
        WorkerPool(settings, [], [("w", (2,))], startup_timeout_s=1.0, remote_workers=1,
                   remote_address=f"127.0.0.1:{_free_port()}")


def _accept_quietly(listener) -> None:
    try:
        listener.accept()
    except Exception:  # noqa: BLE001 - the wrong key is the point
        pass
