"""A short end-to-end GRPO run on the cpu backend: the policy learns something, the reference is
frozen, the rollout engine holds the trained weights, metrics and the HF export are written, and a
reward function that raises, hangs or returns a non-number is scored 0, counted and warned about
once per step without stopping training."""
import json
import os

import pytest
import torch

from periodic_async.config import load_config
from periodic_async.telemetry.logger import read_metrics
from periodic_async.train.trainer import Trainer

from helpers import make_hf_model_dir

REQUIRED = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean",
            "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
            "timing_s/step", "perf/throughput", "training/off_policy/trajectory_staleness/mean",
            "reward/num_errors", "reward/num_timeouts", "reward/num_invalid"]


def _cfg(tmp_path, *extra):
    return load_config("configs/default.yaml", ["trainer.mode=sync",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.progress_bar=false",
        "data.train_batch_size=4", "rollout.n=4", "actor.micro_batch_size=6", "actor.kl_coef=0.1",
        "reward.num_workers=1", *extra])


def test_short_run_changes_policy_not_reference(tmp_path):
    trainer = Trainer(_cfg(tmp_path))
    trainer_engine = trainer.producer.pool.engine
    policy0 = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    ref0 = {n: p.detach().clone() for n, p in trainer.actor.reference.named_parameters()}
    history = trainer.fit()

    assert len(history) == 3
    changed = [n for n, p in trainer.actor.policy.named_parameters() if not torch.equal(p, policy0[n])]
    assert len(changed) == len(policy0)               # every policy parameter moved
    for n, p in trainer.actor.reference.named_parameters():
        assert torch.equal(p, ref0[n]), n             # the reference never does
    assert all(not p.requires_grad for p in trainer.actor.reference.parameters())

    # the (colocated) rollout engine holds exactly the trained policy (version 3)
    engine_obj = trainer_engine
    assert engine_obj.policy_version == 3
    engine = dict(engine_obj.model.named_parameters())
    for name, t in trainer.actor.export_weights():
        assert torch.equal(engine[name], t), name

    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in REQUIRED:
        assert all(key in r for r in records), key
    assert all(r["training/off_policy/trajectory_staleness/mean"] == 0.0 for r in records)
    assert records[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)   # policy == reference at step 1
    assert records[2]["actor/kl_loss"] > 0.0
    assert all(r["perf/total_num_tokens"] > 0 and r["perf/throughput"] > 0 for r in records)

    # the final policy exported as a HF directory that transformers loads
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "final_hf"))
    for name, p in final.named_parameters():
        if name in engine:
            assert torch.equal(p, engine[name]), name


def test_reward_that_raises_is_scored_zero_and_training_goes_on(tmp_path):
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(
        "def compute_score(response, answer):\n"
        "    if response.strip()[:1] == answer:\n"
        "        raise RuntimeError('boom')\n"
        "    return 1.0 if response.strip()[:1].isdigit() else 0.0\n")
    cfg = _cfg(tmp_path, "reward.name=custom", f"reward.custom_file={reward_file}", "trainer.total_steps=2",
               "data.train_batch_size=8", "rollout.n=8")
    history = Trainer(cfg).fit()
    assert len(history) == 2
    errors = sum(h["reward/num_errors"] for h in history)
    assert errors > 0                                  # some responses hit the right digit and raised
    assert all(h["critic/score/max"] <= 1.0 for h in history)


FAULTY_REWARD = """
import os, time

def _claim(marks):
    # each fault happens exactly once in the run: the first call that creates a kind's marker file
    for kind in ("hang", "raise", "nan", "text"):
        try:
            os.close(os.open(os.path.join(marks, kind), os.O_CREAT | os.O_EXCL))
            return kind
        except FileExistsError:
            pass
    return None

def compute_score(response, answer):
    kind = _claim(MARKS)
    if kind == "hang":
        time.sleep(60)
    if kind == "raise":
        raise RuntimeError("boom")
    if kind == "nan":
        return float("nan")
    if kind == "text":
        return "one"
    return 1.0 if response.strip()[:1].isdigit() else 0.0
"""


def test_reward_faults_are_scored_zero_counted_and_warned_once_per_step(tmp_path, caplog):
    """A reward fn that hangs, raises, returns NaN and returns a string (once each, all in step 1):
    the hang ends at reward.timeout_s, each item scores 0 and is counted by cause, and the step logs
    one summary warning - not a line per item; step 2 has none."""
    import logging
    marks = tmp_path / "marks"
    marks.mkdir()
    reward_file = tmp_path / "faulty_reward.py"
    reward_file.write_text(f"MARKS = {str(marks)!r}\n" + FAULTY_REWARD)
    cfg = _cfg(tmp_path, "reward.name=custom", f"reward.custom_file={reward_file}", "reward.timeout_s=2",
               "trainer.total_steps=2", "trainer.save_final=false")
    with caplog.at_level(logging.DEBUG):
        history = Trainer(cfg).fit()
    faults = [(h["reward/num_errors"], h["reward/num_timeouts"], h["reward/num_invalid"]) for h in history]
    assert faults == [(1, 1, 2), (0, 0, 0)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    reward_warnings = [w for w in warnings if "reward" in w]
    assert reward_warnings == ["step 1: reward fn failed on 4 of 16 responses, scored 0.0 (1 raised or lost "
                               "their worker, 1 timed out, 2 returned a non-number or non-finite value); first: "
                               "no result within reward.timeout_s=2 s (its worker was killed and replaced)"]
    assert history[0]["critic/score/min"] == 0.0


@pytest.mark.parametrize("own_model", [False, True])
def test_config_saved_in_run_dir(tmp_path, own_model):
    """Every run writes its config, with the tiny model or a checkpoint of its own (model.path)."""
    extra = [f"model.path={make_hf_model_dir(tmp_path / 'ckpt', vocab=24, hidden=64, heads=2, kv_heads=2)}"] \
        if own_model else []
    cfg = _cfg(tmp_path, "trainer.total_steps=1", "trainer.save_final=false", *extra)
    Trainer(cfg).fit()
    import yaml
    saved = yaml.safe_load(open(tmp_path / "run" / "config.yaml"))
    assert saved["rollout"]["n"] == 4 and saved["trainer"]["total_steps"] == 1
    assert saved["model"]["path"] == (str(tmp_path / "ckpt") if own_model else None)
    assert os.path.exists(tmp_path / "run" / "model_init") != own_model
    assert not os.path.exists(tmp_path / "run" / "final_hf")


def test_non_finite_gradients_skip_the_update_and_stop_the_run(tmp_path):
    """A step whose gradient norm is not finite changes nothing and is counted; after
    trainer.max_nonfinite_steps such steps in a row the run stops with a message saying why."""
    from periodic_async import algo
    from periodic_async.train.trainer import NonFiniteTraining

    @algo.register_policy_loss("test_nan")
    class NaNLoss(algo.losses.GRPOLoss):
        def __call__(self, x):
            loss, m = super().__call__(x)
            return loss * float("nan"), m
    try:
        trainer = Trainer(_cfg(tmp_path, "actor.policy_loss=test_nan", "trainer.max_nonfinite_steps=2",
                               "trainer.save_final=false"))
        before = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
        with pytest.raises(NonFiniteTraining, match=r"2 steps in a row \(up to step 2\) had a non-finite gradient "
                                                   r"norm and were skipped \(trainer.max_nonfinite_steps=2\)"):
            trainer.fit()
    finally:
        algo.POLICY_LOSSES.pop("test_nan")
    for n, p in trainer.actor.policy.named_parameters():
        assert torch.equal(p, before[n]), n
    records = read_metrics(str(tmp_path / "run"))
    assert [r["actor/step_skipped"] for r in records] == [1.0, 1.0]
    assert [r["trainer/nonfinite_steps_in_a_row"] for r in records] == [1, 2]


def test_startup_says_each_fact_once(tmp_path):
    """`python -m periodic_async` start-up: Megatron-core's Apex / Transformer Engine fallback
    warnings (four per process that imports it: the trainer and every rollout worker), its FSDP
    INFO lines, the workers' HF loading bars and math-verify's 'Timeout is disabled' notices (each
    reward worker) are gone; the fallback is said once."""
    import subprocess
    import sys
    from periodic_async.backend_setup import megatron_fallback_note
    proc = subprocess.run(
        [sys.executable, "-m", "periodic_async", "--config", "configs/default.yaml", "trainer.total_steps=1",
         f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false", "trainer.save_final=false",
         "trainer.save_every=0", "reward.name=gsm8k", "reward.num_workers=1"],
        capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for noise in ("Falling back to", "megatron_fsdp", "Loading weights", "Timeout is disabled", "Warning"):
        assert noise not in out, out
    note = megatron_fallback_note()
    assert out.count(note or "not installed") == (1 if note else 0), out
