"""Pilot-commit allocation and in-batch backfill wired into training (scheduling/plan.py:
AllocatedPlan, the producers, train/step.py's padding), end to end with real rollout workers.

The promises: each switch keeps training strictly on-policy and `periodic` equal to `sync` (the
same decisions, losses and parameters, also with shuffled arrival and a worker killed mid-pilot);
every rollout the allocator counts is generated exactly once and the budget holds; a step with
nothing to train on leaves the policy as it was; a resumed run makes the same decisions.
The allocator's decision logic itself is tested in test_allocation.py.
"""
import copy
import json

import pytest
import torch

from periodic_async.config import load_config
from periodic_async.config.loading import ConfigError
from periodic_async.train.trainer import Trainer

from helpers import kill_worker_hook

STEPS = 3
LOSS_KEYS = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"]
# long_tail: rewards 0 / partial credit / 1, so groups of equal rewards and pilots of every verdict occur
BASE = ["data.train_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=8", "actor.micro_batch_size=6",
        "actor.kl_coef=0.1", "reward.num_workers=0", "actor.adam_eps=1e-4", "trainer.save_final=false",
        "trainer.progress_bar=false"]
SWITCHES = {
    # groups of 2: at random init rewards are mostly 0.0 or 0.1, so many pairs are equal and
    # backfill acts in every run (with 4, one run of 3 steps saw none)
    "backfill": ["rollout.selection=backfill", "rollout.n=2"],
    # success = the first character right (reward >= 0.1); n_pilot 2 (K // 4 = 1 has no count in the
    # official band [1/8, 3/4]): 1 of 2 passes, 2 of 2 evicted from the next epoch, 0 of 2 deferred;
    # 12 candidates whose pilots leave budget for 4 commits, so surplus passers go to the prompt
    # reserve (its fill rounds and the fresh fills are tested in test_allocation.py / test_pilot_official.py)
    "pilot": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.1", "rollout.pilot.n_pilot=2",
              "rollout.pilot.num_candidates=12"],
}


def _cfg(run_dir, mode, *extra, steps=STEPS):
    return load_config("configs/long_tail.yaml", [f"trainer.run_dir={run_dir}", f"trainer.mode={mode}",
                                                  f"trainer.total_steps={steps}", *BASE, *extra])


def _run(run_dir, mode, *extra, hook=None, steps=STEPS):
    trainer = Trainer(_cfg(run_dir, mode, *extra, steps=steps))
    generated = []      # rollouts generated per step
    if hook:
        hook(trainer)
    producer = trainer.producer
    step = trainer.step

    def counting_step(n):
        metrics = step(n)
        generated.append(len(producer.stats.results))
        return metrics
    trainer.step = counting_step
    history = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    return history, params, generated


def _decisions(h):
    return {k: v for k, v in h.items() if k.startswith(("pilot/", "rollout/backfill", "rollout/zero_variance",
                                                         "rollout/rollouts", "alloc/"))}


def _assert_same_training(history, params, ref_history, ref_params):
    assert len(history) == len(ref_history)
    for step, (h, r) in enumerate(zip(history, ref_history), 1):
        h, r = dict(h), dict(r)
        score_all = h.pop("alloc/score_all/mean", None), r.pop("alloc/score_all/mean", None)
        assert _decisions(h) == _decisions(r), f"step {step}: the allocator decided differently"
        if score_all != (None, None):      # (both None without an allocator)
            assert score_all[0] == pytest.approx(score_all[1], rel=1e-12), step     # summed in arrival order
        for k in LOSS_KEYS:
            assert h[k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), f"step {step} {k}: {h[k]} vs {r[k]}"
    for n in params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.fixture(scope="module", params=sorted(SWITCHES))
def sync_run(request, tmp_path_factory):
    name = request.param
    history, params, generated = _run(tmp_path_factory.mktemp(f"sync_{name}"), "sync", *SWITCHES[name])
    return name, history, params, generated


def test_switch_acts_and_every_counted_rollout_is_generated_once(sync_run):
    name, history, _, generated = sync_run
    counter = "pilot/rollouts" if name == "pilot" else "rollout/rollouts"
    for h, n in zip(history, generated):
        assert h[counter] == n                       # what the allocator sent is what was generated
        if name == "pilot":
            assert n <= h["pilot/budget"] == 8 * 4
            assert h["alloc/trainable_groups"] == h["pilot/committed"]
            assert h["rollout/group_size/mean"] == 4
        else:
            assert n == (8 + h["rollout/backfilled"]) * 2
            assert h["alloc/trainable_groups"] == 8 - h["rollout/backfill_unreplaced"]
    # the switch did something in this run (otherwise the equality tests below prove nothing)
    if name == "pilot":
        assert sum(h["pilot/committed"] for h in history) > 0
        assert sum(h["pilot/solved_dropped"] + h["pilot/deferred"] for h in history) > 0
        assert sum(h["pilot/replay_added"] for h in history) > 0      # surplus passers kept
    else:
        assert sum(h["rollout/backfilled"] for h in history) > 0


def test_periodic_with_shuffled_arrival_equals_sync(sync_run, tmp_path):
    name, ref_history, ref_params, _ = sync_run
    history, params, _ = _run(tmp_path, "periodic", *SWITCHES[name], "rollout.num_workers=2",
                              "rollout.max_slots=3", "rollout.arrival_jitter_s=0.01")
    _assert_same_training(history, params, ref_history, ref_params)


def test_worker_killed_mid_step_loses_nothing(sync_run, tmp_path):
    """A worker SIGKILLed after the step's first request is rewarded (mid-pilot / mid-backfill): its
    samples are generated again, and training equals sync."""
    name, ref_history, ref_params, _ = sync_run
    killed = {}
    history, params, _ = _run(tmp_path, "periodic", *SWITCHES[name], "rollout.num_workers=2", "rollout.max_slots=3",
                              hook=kill_worker_hook(killed, at_version=1))
    assert killed, "no worker was killed"
    _assert_same_training(history, params, ref_history, ref_params)
    assert history[-1]["rollouter/restarts"] == 1


def test_resumed_run_makes_the_same_decisions(sync_run, tmp_path):
    """The allocator's state (solved / deferred sets, replay buffer) is in the checkpoint: a run
    stopped after step 2 and resumed decides and trains steps 3.. as the uninterrupted run did."""
    name, ref_history, ref_params, _ = sync_run
    first, _, _ = _run(tmp_path, "sync", *SWITCHES[name], "trainer.save_every=2", steps=2)
    meta = json.loads(next((tmp_path / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["allocator"] is not None
    rest, params, _ = _run(tmp_path, "sync", *SWITCHES[name], "trainer.resume=auto")
    assert len(first) == 2 and len(rest) == STEPS - 2
    _assert_same_training(first + rest, params, ref_history, ref_params)


def test_step_with_nothing_to_train_leaves_the_policy_unchanged(tmp_path):
    """Every pilot deferred (no exact answer from a random model): no group is trainable, each
    step runs loss-free padding micro-batches and skips the update."""
    trainer = Trainer(_cfg(tmp_path, "periodic", "rollout.selection=pilot", "rollout.pilot.success_threshold=1.0",
                           "rollout.pilot.n_pilot=2", steps=2))
    before = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    history = trainer.fit()
    for h in history:
        assert h["alloc/trainable_groups"] == 0 and h["training/empty_batch"] == 1.0
        # B = 8 pilots of 2, all deferred, then one fresh fill round: (32 - 16 - 2 commit) // 2 = 7
        # more, all deferred; 30 of the 32 rollouts leave no room for a pilot and its commit
        assert h["pilot/deferred"] == 15 and h["pilot/fresh_filled"] == 7 and h["pilot/rollouts"] == 30
        assert h["actor/step_skipped"] == 0.0
        assert "critic/score/mean" not in h and h["alloc/score_all/mean"] < 1.0
    for n, p in trainer.actor.policy.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_padding_micro_batches_carry_no_loss(tmp_path):
    """The pilot's empty positions pad DP rank 0's micro-batches: the step equals one whose plan
    had only the trained groups (the same gradient and metric sums, not just a finite one)."""
    from periodic_async.train import step as step_mod
    from periodic_async.train.feed import GroupFeed

    trainer = Trainer(_cfg(tmp_path / "a", "sync", *SWITCHES["pilot"], steps=1))
    plan, _ = trainer.producer.batch(1)
    groups = list(trainer.producer.groups(1))
    trained = [g for g in groups if g.size]
    assert 0 < len(trained) < len(groups)      # some positions stayed empty
    state = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    opt_state = copy.deepcopy(trainer.actor.optimizer.inner.state_dict())

    padded = step_mod.train_batch(trainer.actor, GroupFeed(plan.train_sizes, iter(groups), None),
                                  trainer.cfg.actor, 0, 1, lambda g: None)
    after_padded = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    with torch.no_grad():
        for n, p in trainer.actor.policy.named_parameters():
            p.copy_(state[n])
    trainer.actor.optimizer.inner.load_state_dict(opt_state)
    exact = step_mod.train_batch(trainer.actor, GroupFeed({g.group_index: g.size for g in trained}, iter(trained),
                                                          None), trainer.cfg.actor, 0, 1, lambda g: None)
    for k in LOSS_KEYS:
        assert padded.metrics[k] == pytest.approx(exact.metrics[k], rel=1e-6, abs=1e-9), k
    for n, p in trainer.actor.policy.named_parameters():
        torch.testing.assert_close(after_padded[n], p.detach(), rtol=1e-6, atol=1e-8, msg=lambda m: f"{n}: {m}")
    trainer.close()


@pytest.mark.parametrize("overrides, message", [
    (["rollout.pilot.enabled=true"], "rollout.pilot.enabled: set rollout.selection: pilot instead"),
    (["rollout.selection=backfill", "rollout.backfill.max_groups=-1"], "rollout.backfill.max_groups must be >= 0"),
    (["rollout.selection=pilot", "rollout.pilot.n_pilot=4"], "rollout.pilot.n_pilot must be in [1, rollout.n - 1]"),
    # the allocator takes each step's K from the sizer: every candidate must leave a commit
    (["rollout.selection=pilot", "rollout.pilot.n_pilot=2", "rollout.group_sizing=sagc", "rollout.sagc.candidates=[2, 4]"],
     "rollout.sagc.candidates: with K = 2: rollout.pilot.n_pilot must be in"),
    (["rollout.selection=pilot", "rollout.pilot.n_pilot=2", "rollout.pilot.budget=9"],
     "rollout.pilot.budget: 9 rollouts do not cover"),
    (["rollout.selection=pilot"], "no success count s of n_pilot=1 (n_pilot unset: K // 4)"),
    (["rollout.selection=pilot", "rollout.pilot.p_upper=0.9"], "rollout.pilot.p_upper: replaced by pass_lower"),
])
def test_bad_allocation_config_is_refused_naming_the_key(tmp_path, overrides, message):
    cfg = _cfg(tmp_path, "sync", *overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=1, num_heads=2, num_kv_heads=2, vocab_size=32, num_layers=2)
    assert message in str(e.value)
