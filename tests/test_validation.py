"""Validation (train/validation.py): held-out prompts scored on the rollout side between batches.

The trainer's numbers are checked against a direct computation: the run's final policy (its HF
export) loaded into a fresh HF engine, the same requests generated, scored with the same reward.
A periodic run (workers) gives the same numbers as a sync run (colocated engine).
"""
from __future__ import annotations

import pytest

from periodic_async.config import ConfigError, load_config
from periodic_async.telemetry.logger import read_metrics
from periodic_async.train.trainer import Trainer

COMMON = ["trainer.total_steps=2", "trainer.progress_bar=false", "data.train_batch_size=8", "rollout.n=4",
          "rollout.max_new_tokens=4", "actor.micro_batch_size=8", "reward.num_workers=0", "trainer.tensorboard=false",
          "data.val_size=6", "trainer.val_every=2", "trainer.val_n=3", "actor.lr=3e-3"]
KEY = "val-core/synthetic/reward"


def _run(run_dir, mode, *extra):
    trainer = Trainer(load_config("configs/default.yaml", [*COMMON, f"trainer.mode={mode}", f"trainer.run_dir={run_dir}",
                                                           *extra]))
    val_prompts = [r.prompt for r in trainer._val_records]
    trainer.fit()
    return read_metrics(str(run_dir)), trainer, val_prompts


@pytest.fixture(scope="module")
def sync_val(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("val_sync"), "sync")


def test_validation_equals_a_direct_evaluation_of_the_final_policy(sync_val, tmp_path):
    from periodic_async.reward.manager import RewardManager
    from periodic_async.rollout.hf_engine import HFRolloutEngine
    records, trainer, prompts = sync_val
    assert [r["step"] for r in records] == [0, 1, 2]            # step 0: before training
    assert KEY + "/greedy@1" in records[0] and KEY + "/mean@3" in records[2] and KEY + "/greedy@1" not in records[1]
    run_dir = trainer.cfg.trainer.run_dir
    train_prompts = {r.prompt for r in trainer._records}
    assert not train_prompts & set(prompts)                        # held out: never trained on

    engine = HFRolloutEngine(f"{run_dir}/final_hf", trainer.pad_id, trainer.eos_id, 64, "cpu")
    try:
        results = sorted(engine.generate(trainer.validator.requests), key=lambda r: (r.group_index, r.sample_index))
    finally:
        engine.close()
    m = len(prompts)
    reward = RewardManager(trainer.cfg.reward)
    answers = [trainer._val_records[r.group_index % m].answer for r in results]
    decode = lambda ids: trainer.tokenizer.decode(ids, skip_special_tokens=True)   # noqa: E731
    scores = reward.score([(decode(r.response_ids), a) for r, a in zip(results, answers)]).scores
    reward.close()
    greedy = [s for r, s in zip(results, scores) if r.group_index < m]
    sampled = {}
    for r, s in zip(results, scores):
        if r.group_index >= m:
            sampled.setdefault(r.group_index, []).append(s)
    assert len(greedy) == m and all(len(v) == 3 for v in sampled.values())
    assert records[2][KEY + "/greedy@1"] == pytest.approx(sum(greedy) / m, abs=1e-12)
    assert records[2][KEY + "/mean@3"] == pytest.approx(sum(map(sum, sampled.values())) / (3 * m), abs=1e-12)
    assert records[2][KEY + "/best@3"] == pytest.approx(sum(map(max, sampled.values())) / m, abs=1e-12)
    # the policy moved: the step-0 validation judged another one (a test of the wrong weights would match both)
    assert any(records[0][k] != records[2][k] for k in (KEY + "/greedy@1", KEY + "/mean@3", KEY + "/best@3"))


def test_validation_on_rollout_workers_equals_sync(sync_val, tmp_path):
    want = sync_val[0]
    got, _, _ = _run(tmp_path, "periodic", "rollout.num_workers=1")
    for step in (0, 2):
        for k in ("/greedy@1", "/mean@3", "/best@3"):
            assert got[step][KEY + k] == pytest.approx(want[step][KEY + k], abs=1e-12), (step, k)


def test_validation_needs_prompts():
    with pytest.raises(ConfigError, match="trainer.val_every: validation needs prompts"):
        load_config("configs/default.yaml", ["trainer.val_every=2"]).validate(world_size=1)


def test_val_path_reads_its_own_file_and_val_size_holds_out_repeats(tmp_path):
    import dataclasses
    import json

    from periodic_async.config import DataConfig
    from periodic_async.data.records import PromptRecord
    from periodic_async.train.validation import split_validation
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    train = [PromptRecord("a", "1", 0), PromptRecord("b", "2", 1), PromptRecord("a", "1", 2)]
    cfg = DataConfig(source="jsonl", path="unused.jsonl", val_path=str(val))
    got_train, got_val = split_validation(train, cfg)
    assert got_train == train and [r.prompt for r in got_val] == ["q0", "q1", "q2"]
    got_train, got_val = split_validation(train, dataclasses.replace(cfg, val_path=None, val_size=1))
    assert [r.prompt for r in got_val] == ["a"] and [r.prompt for r in got_train] == ["b"]   # the repeat of "a" too
