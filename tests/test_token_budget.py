"""Micro-batches by token budget (actor.micro_batch_tokens; scheduling/dp_assignment.py's
cut_by_tokens and its count bound, train/step.py): every micro-batch's padded tensor stays within
the budget, the count the pipeline schedule is started with is never too small and is the same on
every DP rank, and the loss and the update equal fixed-count micro-batches on the same batch."""
import copy
import random

import pytest
import torch

from periodic_async.config import load_config
from periodic_async.config.loading import ConfigError
from periodic_async.memory_plan import num_micro_steps
from periodic_async.scheduling.dp_assignment import (TokenBudget, assign_groups, atoms_per_micro_batch, cut_by_tokens,
                                                     num_micro_batches_by_tokens)

LOSS_KEYS = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"]


def _area(atoms):
    return sum(r for r, _, _ in atoms) * max(w for _, w, _ in atoms)


def test_cut_by_tokens_packs_in_order_within_the_budget_by_hand():
    # widths 10, 10, 30, 5, 5, 5 (one row each), budget 40: [10, 10] would take a 30 only as
    # 3 x 30 = 90 > 40, so it closes; [30] closes at once ((1 + 1) x 30 > 40); then 5s: 8 fit
    atoms = [(1, w, [i]) for i, w in enumerate([10, 10, 30, 5, 5, 5])]
    assert list(cut_by_tokens(atoms, 40)) == [[0, 1], [2], [3, 4, 5]]
    # a group atom of 3 rows x 8 = 24 and one of 2 x 9: (3 + 2) x 9 = 45 > 40, separate
    assert list(cut_by_tokens([(3, 8, "abc"), (2, 9, "de")], 40)) == [list("abc"), list("de")]
    assert list(cut_by_tokens([(3, 8, "abc"), (1, 9, "d")], 40)) == [list("abcd")]
    with pytest.raises(ValueError, match="actor.micro_batch_tokens: an atom of 1 x 41 tokens is over the budget 40"):
        list(cut_by_tokens([(1, 41, [0])], 40))


def test_cut_by_tokens_closes_a_full_micro_batch_without_pulling_the_next_atom():
    """Streaming: a micro-batch no further row fits is handed over before the next group arrives."""
    pulled = []

    def atoms():
        for i, w in enumerate([20, 20, 3]):
            pulled.append(i)
            yield 1, w, [i]
    cuts = cut_by_tokens(atoms(), 40)
    assert next(cuts) == [0, 1] and pulled == [0, 1]      # 2 x 20 = 40: full, atom 2 not yet pulled
    assert list(cuts) == [[2]]


@pytest.mark.parametrize("seed", range(6))
def test_the_count_bound_holds_for_any_lengths_and_order(seed):
    """However long the responses come out and in whatever order, the cuts stay within the budget
    and their number within the bound the schedule was started with; the bound is the fixed-count
    split whose micro-batches of maximum-length sequences fit the budget."""
    rng = random.Random(seed)
    for _ in range(300):
        bound_rows, bound_width = rng.choice([(1, rng.randint(2, 40)), (rng.randint(1, 8), rng.randint(2, 20))])
        budget = bound_rows * bound_width * rng.randint(1, 6) + rng.randint(0, bound_width)
        n = rng.randint(1, 60)
        atoms = [(rng.randint(1, bound_rows), rng.randint(1, bound_width), [i]) for i in range(n)]
        cuts = list(cut_by_tokens(atoms, budget))
        by_index = {a[2][0]: a for a in atoms}
        assert [i for c in cuts for i in c] == list(range(n))       # in order, each once
        for c in cuts:
            assert _area([by_index[i] for i in c]) <= budget
        bound = num_micro_batches_by_tokens([n], budget, bound_rows, bound_width)
        assert len(cuts) <= bound
        assert bound == -(-n // (budget // (bound_rows * bound_width)))
        # maximum-size atoms meet the bound exactly: it is not loose
        worst = list(cut_by_tokens([(bound_rows, bound_width, [i]) for i in range(n)], budget))
        assert len(worst) == bound


def test_every_dp_rank_runs_the_same_count():
    sizes = {0: 8, 1: 8, 2: 4, 3: 0, 4: 8}
    owner = assign_groups(sizes, 2)
    budget = TokenBudget(tokens=200, max_prompt=10, max_new=30)
    # atoms: samples; rank loads 12 and 16 (assign_groups); 200 // 40 = 5 per micro-batch
    loads = [sum(k for g, k in sizes.items() if owner[g] == r) for r in range(2)]
    assert sorted(loads) == [12, 16]
    assert budget.num_micro_batches(sizes, owner, 2) == 4            # ceil(16 / 5) on both ranks
    shared = TokenBudget(tokens=250, max_prompt=10, max_new=30, shared_prompt=True)
    # atoms: non-empty groups, bound 10 + 8 x 30 = 250: one group per micro-batch; ranks hold 2 groups each
    assert shared.num_micro_batches(sizes, owner, 2) == 2
    with pytest.raises(ValueError, match="cannot hold one atom at its maximum size 1 x 250"):
        TokenBudget(tokens=249, max_prompt=10, max_new=30, shared_prompt=True).num_micro_batches(sizes, owner, 2)


def test_atoms_follow_the_layout():
    groups = [[(5, 3), (5, 7)], [], [(4, 1)]]
    lengths = lambda x: x         # noqa: E731
    assert list(TokenBudget(100, 8, 10).atoms(groups, lengths)) == [(1, 8, [(5, 3)]), (1, 12, [(5, 7)]),
                                                                    (1, 5, [(4, 1)])]
    assert list(TokenBudget(100, 8, 10, shared_prompt=True).atoms(groups, lengths)) == [
        (1, 15, [(5, 3), (5, 7)]), (1, 5, [(4, 1)])]
    assert list(TokenBudget(100, 8, 10, whole_groups=True).atoms(groups, lengths)) == [
        (2, 12, [(5, 3), (5, 7)]), (1, 5, [(4, 1)])]


# ---------------------------------------------------------------------- config and memory plan

BASE = ["data.train_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=24", "actor.kl_coef=0.1",
        "reward.num_workers=0", "actor.adam_eps=1e-4", "trainer.save_final=false", "trainer.progress_bar=false"]


def _cfg(run_dir, *extra, steps=1):
    return load_config("configs/long_tail.yaml", [f"trainer.run_dir={run_dir}", "trainer.mode=sync",
                                                  f"trainer.total_steps={steps}", *BASE, *extra])


def _validate(cfg):
    cfg.validate(world_size=1, num_heads=2, num_kv_heads=2, vocab_size=32, num_layers=2)


@pytest.mark.parametrize("overrides, message", [
    (["actor.micro_batch_tokens=71"], "actor.micro_batch_tokens: 71 cannot hold one sequence: data.max_prompt_length "
                                      "48 + rollout.max_new_tokens 24 = 72 tokens; raise it to at least 72"),
    (["actor.micro_batch_tokens=143", "actor.shared_prompt=true"],
     "cannot hold one shared-prompt group: data.max_prompt_length 48 + 4 x rollout.max_new_tokens 24 = 144 tokens"),
    (["actor.micro_batch_tokens=0"], "actor.micro_batch_tokens: must be a positive integer"),
    (["actor.micro_batch_tokens=200", "algo.adv_estimator=vcpo_baseline", "actor.policy_loss=decoupled_ppo"],
     "cannot hold one whole group (algo.adv_estimator vcpo_baseline): 4 x (data.max_prompt_length 48"),
])
def test_a_budget_too_small_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        _validate(_cfg(tmp_path, *overrides))
    assert message in str(e.value)


def test_vcpo_baseline_with_sagc_needs_whole_groups_which_a_budget_gives(tmp_path):
    """Without a budget vcpo_baseline refuses varying K (a fixed-count cut could split a group);
    a budget packs whole groups whatever their K."""
    keys = ["algo.adv_estimator=vcpo_baseline", "actor.policy_loss=decoupled_ppo", "rollout.group_sizing=sagc",
            "rollout.sagc.candidates=[2, 4]"]
    with pytest.raises(ConfigError, match="or set actor.micro_batch_tokens"):
        _validate(_cfg(tmp_path, *keys))
    _validate(_cfg(tmp_path, *keys, "actor.micro_batch_tokens=300"))


def test_the_memory_plan_uses_the_budget(tmp_path):
    from periodic_async.memory_plan import micro_batch_tokens
    fixed = _cfg(tmp_path, "actor.micro_batch_size=16")
    assert micro_batch_tokens(fixed)[0] == 16 * 72
    budget = _cfg(tmp_path, "actor.micro_batch_tokens=300")
    assert micro_batch_tokens(budget) == (300, 300 // 72, 300)
    assert num_micro_steps(budget, 1) == -(-32 // (300 // 72))        # 8 x 4 sequences, 4 per micro-batch
    shared = _cfg(tmp_path, "actor.micro_batch_tokens=300", "actor.shared_prompt=true")
    assert micro_batch_tokens(shared) == (300, 0, 300) and num_micro_steps(shared, 1) == 4   # 2 groups of 144


# ---------------------------------------------------------------------- the loss is unchanged


@pytest.fixture(scope="module")
def batch_and_trainer(tmp_path_factory):
    from periodic_async.train.trainer import Trainer
    trainer = Trainer(_cfg(tmp_path_factory.mktemp("budget"), "actor.micro_batch_size=6"))
    plan, _ = trainer.producer.batch(1)
    groups = list(trainer.producer.groups(1))
    yield trainer, plan.train_sizes, groups
    trainer.close()


def _train(trainer, sizes, groups, actor_cfg, budget=None):
    from periodic_async.train import step as step_mod
    from periodic_async.train.feed import GroupFeed
    state = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    opt_state = copy.deepcopy(trainer.actor.optimizer.inner.state_dict())
    out = step_mod.train_batch(trainer.actor, GroupFeed(sizes, iter(groups), None), actor_cfg, 0, 1,
                               lambda g: None, budget=budget)
    after = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    with torch.no_grad():
        for n, p in trainer.actor.policy.named_parameters():
            p.copy_(state[n])
    trainer.actor.optimizer.inner.load_state_dict(opt_state)
    return out, after


@pytest.mark.parametrize("tokens", [72, 300, 4000])
def test_a_token_budget_trains_as_fixed_count_micro_batches(batch_and_trainer, tokens):
    """Same batch, same start: the budget's micro-batches (one sequence each, a few, or the whole
    batch in one) give the fixed-count split's loss metrics and updated parameters, up to the
    floating-point summation order; the padding micro-batches of the count bound add nothing."""
    trainer, sizes, groups = batch_and_trainer
    fixed, fixed_params = _train(trainer, sizes, groups, trainer.cfg.actor)
    budget = TokenBudget(tokens, trainer.cfg.data.max_prompt_length, trainer.cfg.rollout.max_new_tokens)
    cut, cut_params = _train(trainer, sizes, groups, trainer.cfg.actor, budget)
    for k in LOSS_KEYS:
        assert cut.metrics[k] == pytest.approx(fixed.metrics[k], rel=1e-5, abs=1e-8), k
    # Adam's first update is lr * g / (|g| + eps): for an element whose gradient is near zero the
    # summation order alone moves it by ~1e-7 (a fresh-clone suite saw 1.2e-7 in one of 1,536 embedding elements),
    # while a sample lost or counted twice moves many updates by a good share of lr (adam_eps 1e-4
    # keeps small gradients in the linear range). So allow 1e-3 x lr absolute.
    atol = 1e-3 * trainer.cfg.actor.lr
    for n in fixed_params:
        torch.testing.assert_close(cut_params[n], fixed_params[n], rtol=1e-5, atol=atol, msg=lambda m: f"{n}: {m}")
    n_bound = budget.num_micro_batches(sizes, assign_groups(sizes, 1), 1)
    assert cut.metrics["micro_batch/micro_steps"] + cut.metrics["micro_batch/padding_micro_steps"] == n_bound
    assert fixed.metrics["micro_batch/micro_steps"] == -(-sum(sizes.values()) // 6)
    # the padding share by hand: the fixed split cuts the samples (completion order) every 6
    lens = [len(r.prompt_ids) + len(r.response_ids) for g in groups for r in g.results]
    chunks = [lens[i:i + 6] for i in range(0, len(lens), 6)]
    assert fixed.metrics["micro_batch/padding_ratio"] == pytest.approx(
        1 - sum(lens) / sum(len(c) * max(c) for c in chunks))
    if tokens == 4000:    # the whole batch in one micro-batch (32 x at most 72 tokens)
        assert cut.metrics["micro_batch/micro_steps"] == 1


def test_a_whole_run_with_a_budget_logs_its_micro_batches(tmp_path):
    """Through the Trainer (periodic, shared prompt): the budget is read from the config, the
    micro-batch metrics are logged every step and a micro-batch is never larger than the budget."""
    from periodic_async.train.trainer import Trainer
    cfg = _cfg(tmp_path, "trainer.mode=periodic", "actor.shared_prompt=true", "actor.micro_batch_tokens=300",
               "trainer.record_timeline=true", steps=2)
    trainer = Trainer(cfg)
    history = trainer.fit()
    for h in history:
        assert h["micro_batch/micro_steps"] >= 1
        assert h["micro_batch/micro_steps"] + h["micro_batch/padding_micro_steps"] == 4   # bound: 2 groups of 144 each
        assert 0.0 <= h["micro_batch/padding_ratio"] < 1.0
    import json
    events = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    trains = [e for e in events if e["kind"] == "train"]
    assert trains and all("groups" in e for e in trains)        # the timeline cut as the trainer did
