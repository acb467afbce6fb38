"""Checkpoints and exact resume (train/checkpoint.py).

The end-to-end test SIGKILLs `python -m periodic_async` (periodic mode, one rollout worker) in the
middle of step 4, resumes with trainer.resume=auto from the step-2 checkpoint, and compares every
later step and the final weights with an uninterrupted run of the same config; the HF export of
the resumed run's last checkpoint (python -m periodic_async.export) is the uninterrupted run's
final policy.
"""
from __future__ import annotations

import json
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

STEPS = 4
COMMON = ["trainer.mode=periodic", "rollout.num_workers=1", "trainer.progress_bar=false", "trainer.save_final=false",
          "data.train_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch_size=6",
          "actor.kl_coef=0.1", "reward.num_workers=0", "actor.adam_eps=1e-4", "trainer.tensorboard=false",
          "trainer.save_every=2", "trainer.keep_checkpoints=2", "rollout.arrival_jitter_s=0.03"]
KEYS = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"]


def _fit(run_dir, *extra):
    trainer = Trainer(load_config("configs/default.yaml", [*COMMON, f"trainer.run_dir={run_dir}",
                                                           f"trainer.total_steps={STEPS}", *extra]))
    history = trainer.fit()
    return trainer, history, {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the interrupted ones must equal."""
    run_dir = tmp_path_factory.mktemp("straight")
    _, history, params = _fit(run_dir, "trainer.save_final=true")
    return run_dir, history, params


def _start(run_dir) -> subprocess.Popen:
    """The run as a user starts it; its output goes to a file (a pipe nobody reads while the test
    waits would fill up and block it)."""
    cmd = [sys.executable, "-m", "periodic_async", "--config", "configs/default.yaml", *COMMON,
           f"trainer.run_dir={run_dir}", f"trainer.total_steps={STEPS}"]
    log = open(f"{run_dir}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait_for_lines(proc, metrics, n: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal"


def _assert_resumed_equal(got, got_params, want, want_params, first_step: int) -> None:
    for step, (g, w) in enumerate(zip(got, want[first_step - 1:]), first_step):
        for k in KEYS:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), f"step {step} {k}: {g[k]} vs {w[k]}"
    for n in want_params:      # completion-order summation differs between runs (see test_periodic)
        torch.testing.assert_close(got_params[n], want_params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resumes(straight, tmp_path):
    _, want, want_params = straight
    run_dir = tmp_path / "stopped"
    proc = _start(run_dir)
    _wait_for_lines(proc, run_dir / "metrics.jsonl", 1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    out = open(f"{run_dir}.log").read()
    assert proc.returncode == 130, out[-3000:]
    assert "stopping after this step, with a checkpoint" in out and "interrupted:" in out
    done = [r["step"] for r in read_metrics(str(run_dir))]
    assert done and done[-1] < STEPS, done
    assert os.path.isdir(run_dir / "checkpoints" / f"step_{done[-1]:06d}")       # the last finished step
    trainer, got, got_params = _fit(run_dir)
    assert trainer.start_step == done[-1]
    _assert_resumed_equal(got, got_params, want, want_params, done[-1] + 1)


def test_sigkilled_run_resumes_exactly(straight, tmp_path):
    straight_dir, want, want_params = straight

    run_dir = tmp_path / "killed"
    proc = _start(run_dir)
    _wait_for_lines(proc, run_dir / "metrics.jsonl", 3)   # step 3 logged: step 4 runs, last checkpoint step 2
    os.kill(proc.pid, signal.SIGKILL)                     # the trainer alone: its children must follow
    proc.wait(timeout=30)
    # no orphan: the rollout worker and the checkpoint writer's manager process die with it
    deadline = time.monotonic() + 15
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _group_alive(proc.pid)
    if survivors:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not survivors, "processes outlived the SIGKILLed trainer"
    assert os.path.isdir(run_dir / "checkpoints" / "step_000002")

    trainer, got, got_params = _fit(run_dir)          # trainer.resume: auto (the default)
    assert trainer.start_step == 2 and [h["training/policy_version"] for h in got] == [3, 4]
    _assert_resumed_equal(got, got_params, want, want_params, 3)
    assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2, 3, 4]     # nothing lost or doubled
    kept = sorted(os.listdir(run_dir / "checkpoints"))
    assert kept == ["step_000002", "step_000004"], kept                     # keep_checkpoints: 2

    out = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "periodic_async.export", str(run_dir / "checkpoints" / "step_000004"),
                    str(out)], check=True, capture_output=True, timeout=300)
    from periodic_async.models.convert import SafetensorsReader
    exported, final, init = (SafetensorsReader(str(d)) for d in (out, straight_dir / "final_hf",
                                                                   run_dir / "model_init"))
    assert sorted(exported.names()) == sorted(final.names())
    for n in sorted(exported.names()):
        torch.testing.assert_close(exported(n), final(n), rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert not torch.equal(exported(n), init(n)) or "norm" in n, n             # training moved it


def test_partial_checkpoints_are_never_picked_up(tmp_path):
    from periodic_async.train.checkpoint import RunCheckpointError, resolve_resume
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_000004").mkdir(parents=True)                  # a write cut short
    (root / "step_000003").mkdir()                                    # no meta.json: incomplete
    done = root / "step_000002"
    done.mkdir()
    (done / "meta.json").write_text(json.dumps({"step": 2, "version": 2}))
    assert resolve_resume("auto", str(tmp_path)) == str(done)
    assert resolve_resume("none", str(tmp_path)) is None
    with pytest.raises(RunCheckpointError, match="no meta.json"):
        resolve_resume(str(root / "step_000003"), str(tmp_path))


def _tiny_actor(tmp_path, name: str, hidden: int):
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.config import ActorConfig, TinyModelConfig
    from periodic_async.models.mcore import arch_from_hf_dir
    from periodic_async.models.tiny import make_tiny_model_dir
    model_dir = make_tiny_model_dir(TinyModelConfig(hidden_size=hidden, ffn_hidden_size=2 * hidden),
                                    str(tmp_path / name), seed=0)
    return TriModelActor(ActorConfig(), arch_from_hf_dir(model_dir), model_dir, with_reference=False)


def test_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path, megatron_tp1):
    from periodic_async.train.checkpoint import RunCheckpointError, load_checkpoint, save_checkpoint
    layout = {"tensor_model_parallel_size": 1}
    path = save_checkpoint(str(tmp_path), 2, 0, 1, _tiny_actor(tmp_path, "a", 64).sharded_state_dict(),
                           {"version": 2, "layout": layout}, keep=1)
    other = _tiny_actor(tmp_path, "b", 32)
    with pytest.raises(RunCheckpointError, match=r"step_000002 does not fit this model: rank 0: Global shape mismatch .* for key policy\."):
        load_checkpoint(path, 0, layout, other.sharded_state_dict())


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, dist_cpu, monkeypatch):
    import errno

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from periodic_async.train import checkpoint

    def state():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=0)}
    first = checkpoint.save_checkpoint(str(tmp_path), 2, 0, 1, state(), {"version": 2}, keep=1)

    def full_disk(*a, **kw):   # in Megatron's writer process, at the first tensor written
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(filesystem_async, "_write_item", full_disk)
    with pytest.raises(checkpoint.RunCheckpointError,
                       match="could not write checkpoint .*step_000004: rank 0: .*No space left"):
        checkpoint.save_checkpoint(str(tmp_path), 4, 0, 1, state(), {"version": 4}, keep=1)
    assert checkpoint.complete_checkpoints(str(tmp_path)) == [first]       # keep=1 did not delete it
    assert checkpoint.resolve_resume("auto", str(tmp_path)) == first
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), replica_id=0)}
    assert torch.equal(dist_checkpointing.load(template, os.path.join(first, "dist"))["w"], torch.ones(2))


def test_tp2_run_resumes_exactly_under_torchrun(tmp_path):
    """TP=2 under torchrun: a run resumed from its step-2 checkpoint (the step-4 one removed, as if
    the run had died in step 3) repeats steps 3-4 and ends with the same policy as the
    uninterrupted run. The same checkpoint resharded to TP=1 (one process) resumes too: steps 3-4
    and the final policy equal the TP=2 run's to TP's summation-order tolerance, which a lost or
    misplaced AdamW moment would fail by orders of magnitude; and the single-process export of
    the TP=2 step-4 checkpoint is the TP=2 run's final policy."""
    import shutil

    from test_tensor_parallel import _run_torchrun

    from periodic_async.models.convert import SafetensorsReader
    run_dir = tmp_path / "tp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "periodic_async", "--config", "configs/default.yaml", "trainer.mode=sync",
           "parallel.tensor_model_parallel_size=2", "trainer.progress_bar=false", "data.train_batch_size=4",
           "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch_size=8", "actor.kl_coef=0.1",
           "reward.num_workers=0", "actor.adam_eps=1e-4", "trainer.tensorboard=false", "trainer.save_every=2",
           "trainer.total_steps=4", f"trainer.run_dir={run_dir}"]
    _run_torchrun(cmd, timeout=400)
    want = read_metrics(str(run_dir))
    shutil.move(str(run_dir / "final_hf"), str(tmp_path / "straight_final"))
    subprocess.run([sys.executable, "-m", "periodic_async.export", str(run_dir / "checkpoints" / "step_000004"),
                    str(tmp_path / "exported")], check=True, timeout=300)
    shutil.rmtree(run_dir / "checkpoints" / "step_000004")
    assert sorted(os.listdir(run_dir / "checkpoints" / "step_000002")) == ["dist", "meta.json", "rank_00000.pt",
                                                                         "rank_00001.pt"]
    shutil.copytree(run_dir / "checkpoints" / "step_000002", tmp_path / "step_000002")
    _run_torchrun(cmd, timeout=400)                   # trainer.resume: auto -> step 2
    got = read_metrics(str(run_dir))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        for k in KEYS:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (g["step"], k)
    a, b = SafetensorsReader(str(run_dir / "final_hf")), SafetensorsReader(str(tmp_path / "straight_final"))
    exported = SafetensorsReader(str(tmp_path / "exported"))
    assert sorted(exported.names()) == sorted(b.names())
    for n in sorted(a.names()):
        torch.testing.assert_close(a(n), b(n), rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        torch.testing.assert_close(exported(n), b(n), rtol=0, atol=0, msg=lambda m: f"export {n}: {m}")

    # resharded: the TP=2 step-2 checkpoint resumed at TP=1 in one process
    tp1_dir = tmp_path / "tp1"
    tp1 = [c for c in cmd[cmd.index("--config"):] if not c.startswith(("parallel.", "trainer.run_dir="))]
    subprocess.run([sys.executable, "-m", "periodic_async", *tp1, f"trainer.run_dir={tp1_dir}",
                    f"trainer.resume={tmp_path / 'step_000002'}"], check=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   stdout=open(tmp_path / "tp1.log", "w"), stderr=subprocess.STDOUT)
    resharded = read_metrics(str(tp1_dir))
    assert [r["step"] for r in resharded] == [3, 4]
    for g, w in zip(resharded, want[2:]):
        for k in KEYS:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k, g[k], w[k])
    c = SafetensorsReader(str(tp1_dir / "final_hf"))
    for n in sorted(b.names()):
        torch.testing.assert_close(c(n), b(n), rtol=1e-4, atol=1e-5, msg=lambda m: f"TP=1 resumed {n}: {m}")


def test_the_checkpoint_writers_undeclared_dependency_is_installed_with_the_project():
    """Megatron-core's torch_dist writer needs psutil but does not declare it; without it every
    save hangs. The project's own requirements must bring it (a plain `./run.sh` install has no
    other package that pulls it in)."""
    from importlib.metadata import requires
    names = {r.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower() for r in requires("periodic-async")
             if "extra ==" not in r}
    assert "psutil" in names
