"""One batch of training: the micro-batch stream, the PPO epochs, the batch normaliser.

Epoch 1 consumes the groups as they arrive (completion order) and packs a micro-batch whenever
`actor.micro_batch_size` of this DP rank's sequences are pending, or, with `actor.micro_batch_tokens`,
whenever the pending sequences fill that token budget (dp_assignment.cut_by_tokens); the actor's
pipeline schedule pulls them and blocks only when the next group is not done. Micro-steps sum unnormalised losses
and the gradient is scaled once by the batch's normaliser (its response-token or sequence count)
before the optimizer step, so neither arrival order nor micro-batch split changes anything but the
floating-point summation order. Epochs 2.. replay the stored micro-batches against the old model
(the policy at the batch's start), one optimizer step each.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ..actor.packing import TrainSample, group_by_prompt
from ..algo import batch_normaliser
from ..scheduling.group import Group
from ..scheduling.dp_assignment import TokenBudget, assign_groups, cut_by_tokens, cut_micro_batches, num_micro_batches
from .feed import GroupFeed


def real_tokens(samples: list[TrainSample], shared_prompt: bool) -> int:
    """Tokens of a micro-batch that are not padding (a shared prompt counted once per group)."""
    if shared_prompt:
        return sum(len(g[0].prompt_ids) + sum(len(s.response_ids) for s in g) for g in group_by_prompt(samples))
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


@dataclass
class BatchResult:
    metrics: dict                       # the objective's means, actor/grad_norm, actor/lr, probability check
    groups: list[Group]                 # every group of the batch, in completion order
    wait_s: float = 0.0                 # epoch 1 time spent waiting for the next group
    train_s: float = 0.0                # training time (forward, backward, optimizer steps)
    train_intervals: list = field(default_factory=list)  # (start, end) of each epoch-1 micro-step
    padded_tokens: int = 0              # epoch 1, this rank: the packed tensors' rows x width, summed
    real_tokens: int = 0                # ... of which not padding
    micro_steps: int = 0                # epoch 1 micro-batches with samples, this rank
    padding_micro_steps: int = 0        # epoch 1 loss-free padding micro-batches, this rank


def _micro_batches(actor, feed: GroupFeed, owner: dict[int, int], dp_rank: int, check_group,
                   micro_batch_size: int, out: BatchResult, seat=None, num_micro_batches: int = 0,
                   with_rewards: bool = False, overlong_filter: bool = False, budget: TokenBudget | None = None,
                   rewards_by_std: bool = False):
    """Packed micro-batches of this DP rank's groups as they arrive (the split rule:
    dp_assignment.cut_micro_batches), then loss-free padding up to `num_micro_batches` when groups
    came empty (positions an allocator did not fill). Every group of the batch is received (and
    checked, and kept in `out.groups`), this rank's or not. `seat` (backend.CoreSeat, cpu only):
    cores shared with the rollout workers - given up while waiting for a group, re-divided before
    each micro-step. `with_rewards`: the samples carry their reward and group (the loss re-centres
    the advantages, vcpo_baseline), and every micro-batch must hold whole groups; `rewards_by_std`:
    each divided by its group's reward std (population; not when under 1e-8, as VCPO's official code),
    so that the loss's R - b* comes out divided by it (b* is linear in the rewards).
    `overlong_filter`: responses cut at max_new_tokens carry no loss (DAPO's overlong filtering).
    `budget`: cut by tokens (TokenBudget) instead of every micro_batch_size samples."""
    received = 0

    def next_group():
        nonlocal received
        t0 = time.perf_counter()
        if seat is not None:
            seat.set_busy(False)
        g = feed.get()
        if seat is not None:
            seat.set_busy(True)
        out.wait_s += time.perf_counter() - t0
        received += 1
        check_group(g)
        out.groups.append(g)
        return g

    def my_groups():
        """This rank's groups' samples, in completion order, until its last one has arrived."""
        remaining = sum(1 for g in owner.values() if g == dp_rank)
        while remaining and received < feed.n:
            g = next_group()
            if owner[g.group_index] == dp_rank:
                remaining -= 1
                scale = 1.0
                if with_rewards and rewards_by_std and g.rewards:
                    std = statistics.pstdev(g.rewards)
                    scale = 1.0 / std if std > 1e-8 else 1.0
                yield [TrainSample(r.prompt_ids, r.response_ids, a, r.logprobs, r.policy_version,
                                   reward=rw * scale if with_rewards else None,
                                   group=g.group_index if with_rewards else None, in_loss=in_loss(r, overlong_filter))
                       for r, a, rw in zip(g.results, g.advantages, g.rewards)]

    def split(sample):
        raise RuntimeError(f"group {sample.group} would be split between two micro-batches: "
                           "algo.adv_estimator vcpo_baseline needs actor.micro_batch_size to be a multiple "
                           "of every group's size")

    if budget is not None:
        cuts = cut_by_tokens(budget.atoms(my_groups()), budget.tokens)
    else:
        cuts = cut_micro_batches(my_groups(), micro_batch_size, split if with_rewards else None)
    produced = 0
    for samples in cuts:
        mb = actor.pack(samples)
        out.padded_tokens += mb.input_ids.numel()
        out.real_tokens += real_tokens(samples, mb.shared_prompt)
        # the schedule computes this micro-batch between the yield and its next request; the
        # last one is closed by train_batch when the schedule returns
        interval = [time.perf_counter(), None]
        out.train_intervals.append(interval)
        if seat is not None:
            seat.refresh()
        produced += 1
        yield mb
        if interval[1] is None:
            interval[1] = time.perf_counter()
    while received < feed.n:        # the groups after this rank's last (other DP ranks')
        next_group()
    out.micro_steps = produced
    out.padding_micro_steps = max(0, num_micro_batches - produced)
    for _ in range(num_micro_batches - produced):
        yield actor.pack_padding()


def in_loss(result, overlong_filter: bool) -> bool:
    """Whether a response carries loss: all do, except with actor.overlong_filter the ones cut at
    max_new_tokens (finish_reason "length"; DAPO's overlong filtering)."""
    return not (overlong_filter and result.finish_reason == "length")


def loss_normaliser(groups, loss_agg_mode: str, overlong_filter: bool = False,
                    loss_scale_factor: float | None = None) -> float:
    """The batch's loss normaliser over the responses that carry loss (overlong filtering drops
    the truncated ones from the count too, as DAPO); loss_scale_factor: seq-mean-token-sum-norm's
    constant length."""
    return batch_normaliser([len(r.response_ids) for g in groups for r in g.results
                             if in_loss(r, overlong_filter)], loss_agg_mode, loss_scale_factor)


def _tee(iterator, keep: list):
    """Yield from `iterator`, keeping a copy of every item in `keep` (for the later PPO epochs)."""
    for item in iterator:
        keep.append(item)
        yield item


def train_batch(actor, feed: GroupFeed, cfg, dp_rank: int, dp_size: int, check_group, seat=None,
                with_rewards: bool = False, loss_scale_factor: float | None = None,
                budget: TokenBudget | None = None, rewards_by_std: bool = False) -> BatchResult:
    """Train on one batch: `cfg` the ActorConfig; `check_group(group)` raises on a group that may
    not be trained on (the staleness rule). Every group reaches every rank (feed); this DP rank
    trains on those `assign_groups` gives it. `seat`, `with_rewards`, `budget`, `rewards_by_std`: see
    _micro_batches."""
    owner = assign_groups(feed.sizes, dp_size)
    if budget is not None:
        n_mb = budget.num_micro_batches(feed.sizes, owner, dp_size)
    else:
        n_mb = num_micro_batches(feed.sizes, owner, dp_rank, cfg.micro_batch_size)
    out = BatchResult(metrics={}, groups=[])
    actor.refresh_old()
    # Epoch 1: consume groups as they arrive (old == policy: the old forward is skipped)
    keep = [] if cfg.ppo_epochs > 1 else None
    overlong_filter = getattr(cfg, "overlong_filter", False)
    stream = _micro_batches(actor, feed, owner, dp_rank, check_group, cfg.micro_batch_size, out, seat, n_mb,
                            with_rewards, overlong_filter, budget, rewards_by_std)
    if keep is not None:
        stream = _tee(stream, keep)
    t0 = time.perf_counter()
    sums = actor.forward_backward(stream, n_mb)
    if out.train_intervals and out.train_intervals[-1][1] is None:
        out.train_intervals[-1][1] = time.perf_counter()
    leftover = sum(1 for _ in stream)      # the groups after this rank's last (other DP ranks')
    feed.close()
    t_train_end = time.perf_counter()
    out.train_intervals = [(a, b) for a, b in out.train_intervals]
    if leftover:
        raise RuntimeError(f"the batch packed {n_mb + leftover} micro-batches on DP rank {dp_rank}, {n_mb} expected "
                           f"from its group sizes {sorted(feed.sizes.values())} (a group arrived with another K "
                           "than its request?)")
    out.train_s = t_train_end - t0 - out.wait_s

    if seat is not None:
        seat.set_busy(True)    # the optimizer step (also after a rank whose last group was another's)
    normaliser = loss_normaliser(out.groups, cfg.loss_agg_mode, overlong_filter, loss_scale_factor)
    t0 = time.perf_counter()
    epochs = [sums]
    if normaliser == 0:
        # nothing to train on (every group empty: an allocator found no informative prompt); every
        # rank received the same groups, so every rank skips alike
        out.metrics = {**epoch_means(epochs, [actor.skip_step()], 1.0), "training/empty_batch": 1.0,
                       **micro_batch_metrics(out)}
        return out
    steps = [actor.optimizer_step(grad_scale=1.0 / normaliser)]
    for _ in range(cfg.ppo_epochs - 1):
        epochs.append(actor.forward_backward(keep, len(keep), use_old=True))
        steps.append(actor.optimizer_step(grad_scale=1.0 / normaliser))
    out.train_s += time.perf_counter() - t0
    out.metrics = {**epoch_means(epochs, steps, normaliser), **micro_batch_metrics(out)}
    return out


def micro_batch_metrics(out: BatchResult) -> dict:
    """This rank's epoch-1 micro-batches: how many carried samples, how many were loss-free padding
    (a token budget's count bound, or empty groups), and the share of the packed tokens that was
    padding (micro_batch/ is this project's prefix: verl has no such metric)."""
    return {"micro_batch/micro_steps": float(out.micro_steps),
            "micro_batch/padding_micro_steps": float(out.padding_micro_steps),
            "micro_batch/padding_ratio": 1.0 - out.real_tokens / out.padded_tokens if out.padded_tokens else 0.0}


def epoch_means(epochs: list[dict], steps: list[dict], normaliser: float) -> dict:
    """The step's loss metrics: the objective's sums over the batch divided by the normaliser,
    averaged over the PPO epochs, as are the grad norms; the probability check of epoch 1 (the
    only epoch whose policy generated the batch); the learning rate of the first step; whether
    any optimizer step was skipped (non-finite gradient norm)."""
    out = {k: v for k, v in epochs[0].items() if not k.startswith("actor/")}
    for k in epochs[0]:
        if k.startswith("actor/"):
            out[k] = sum(e[k] for e in epochs) / normaliser / len(epochs)
    out["actor/grad_norm"] = sum(s["actor/grad_norm"] for s in steps) / len(steps)
    out["actor/lr"] = steps[0]["actor/lr"]
    out["actor/step_skipped"] = max(s["actor/step_skipped"] for s in steps)   # 1: an update was skipped
    return out
