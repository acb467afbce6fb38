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
from periodic_async.metrics import read_metrics
from periodic_async.trainer import Trainer

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
    _, history, params = _run(tmp_path_factory.mktemp("sync"), "sync")
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
        source = trainer.source
        produce = source._produce

        def recording_produce(plan):
            produce(plan)
            arrivals.append([r.group_index for r in source.stats.results])
        source._produce = recording_produce

    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=2", "rollout.max_slots=5",
                                    "rollout.arrival_jitter_s=0.01", hook=hook)
    _assert_same_training(history, params, *sync_run)
    # results really arrived out of group order, from both workers
    assert any(order != sorted(order) for order in arrivals)
    assert all(h["training/off_policy/trajectory_staleness/mean"] == 0.0 for h in history)
    assert all(h["trainer/idle_ratio"] < 1 and 0 <= h["rollouter/idle_ratio"] <= 1 for h in history)


def test_sync_split_equals_sync(sync_run, tmp_path):
    _, history, params = _run(tmp_path, "sync_split", "rollout.num_workers=1")
    _assert_same_training(history, params, *sync_run)


def test_worker_killed_mid_batch_is_restarted_and_nothing_is_lost(sync_run, tmp_path):
    killed = {}

    def hook(trainer):
        source = trainer.source
        score = source.scorer.score

        def killing_score(groups, stats):
            # in step 2, after the first complete group: kill worker 0 while it still has work
            if trainer.version == 1 and not killed:
                killed["pid"] = source.pool.pids()[0]
                source.pool.kill_worker(0)
            return score(groups, stats)
        source.scorer.score = killing_score

    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=2", "rollout.max_slots=3",
                                    "rollout.arrival_jitter_s=0.02", "rollout.worker_timeout_s=30", hook=hook)
    assert killed, "the hook never ran"
    _assert_same_training(history, params, *sync_run)
    assert history[1]["rollouter/restarts"] >= 1
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
    """Shared-prompt packing composes with periodic asynchrony: same training as unshared sync."""
    _, history, params = _run(tmp_path, "periodic", "rollout.num_workers=1", "actor.shared_prompt=true")
    _assert_same_training(history, params, *sync_run)


def test_broadcast_weight_sync_with_a_killed_worker_equals_sync(sync_run, tmp_path):
    """rollout.weight_sync=broadcast (a process group per worker, small buckets: the cross-node
    path, here on one node over gloo): same training as sync, also when a worker is SIGKILLed
    mid-batch (its replacement pairs with the pool and receives the current weights)."""
    killed = {}

    def hook(trainer):
        source = trainer.source
        assert source.pool._buf is not None and source.pool._sync_address
        score = source.scorer.score

        def killing_score(groups, stats):
            if trainer.version == 2 and not killed:    # step 3: the replacement needs version 2
                killed["pid"] = source.pool.pids()[1]
                source.pool.kill_worker(1)
            return score(groups, stats)
        source.scorer.score = killing_score

    trainer, history, params = _run(tmp_path, "periodic", "rollout.num_workers=2", "rollout.max_slots=3",
                                    "rollout.weight_sync=broadcast", "actor.export_bucket_mb=0.01",
                                    "rollout.arrival_jitter_s=0.02", "rollout.worker_timeout_s=30", hook=hook)
    assert killed, "the hook never ran"
    _assert_same_training(history, params, *sync_run)
    assert history[2]["rollouter/restarts"] >= 1
