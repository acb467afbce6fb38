"""Which DP rank trains which group, and how a rank's samples become micro-batches: the one rule,
shared by the trainer (train/step.py), the timeline (telemetry/timeline.py) and the torch-free
simulator (tools/sim/replay.py), so that all of them make the same choice."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")


def assign_groups(sizes: dict[int, int], dp_size: int) -> dict[int, int]:
    """group index -> DP rank, balancing the number of samples (groups may differ in K): largest
    group first to the least-loaded rank (ties: lower group index, lower rank). Deterministic, so
    every rank computes the same assignment; with equal K it is group i -> rank i mod DP."""
    load = [0] * dp_size
    owner = {}
    for g in sorted(sizes, key=lambda g: (-sizes[g], g)):
        r = min(range(dp_size), key=lambda r: (load[r], r))
        owner[g] = r
        load[r] += sizes[g]
    return owner


def micro_batch_due(pending: int, groups_left: int, micro_batch_size: int) -> bool:
    """Whether a DP rank packs a micro-batch now, in epoch 1 (groups in completion order): when
    `micro_batch_size` of its samples are pending, or some are and none of its groups is still to
    come (`groups_left` == 0). The micro-batch is the first `micro_batch_size` pending samples."""
    return pending >= micro_batch_size or (pending > 0 and groups_left == 0)


def num_micro_batches(sizes: dict[int, int], owner: dict[int, int], dp_rank: int, micro_batch_size: int) -> int:
    """Micro-batches a DP rank runs in epoch 1 (`cut_micro_batches` of its groups): known up front
    from the group sizes (the pipeline schedule needs the count before the first group arrives)."""
    mine = sum(k for g, k in sizes.items() if owner[g] == dp_rank)
    return -(-mine // micro_batch_size)


def cut_micro_batches(parts: Iterable[Sequence[T]], micro_batch_size: int,
                      on_split: Optional[Callable[[T], None]] = None) -> Iterator[list[T]]:
    """The micro-batch split rule: a DP rank's groups (`parts`, each its samples) in completion
    order, cut every `micro_batch_size` samples as soon as that many are pending; what is left when
    `parts` ends (the rank's last group arrived) is the last, shorter micro-batch. Lazy: a part is
    pulled only when no full micro-batch is pending. `on_split(sample)`: called (to raise) when a
    cut would separate `sample` from the previous sample of its group."""
    pending: list[T] = []
    part_of: list[int] = []
    for i, part in enumerate(parts):
        pending += part
        part_of += [i] * len(part)
        while micro_batch_due(len(pending), 1, micro_batch_size):
            if on_split is not None and len(pending) > micro_batch_size and \
                    part_of[micro_batch_size - 1] == part_of[micro_batch_size]:
                on_split(pending[micro_batch_size])
            batch, pending = pending[:micro_batch_size], pending[micro_batch_size:]
            part_of = part_of[micro_batch_size:]
            yield batch
    if micro_batch_due(len(pending), 0, micro_batch_size):
        yield pending


# ---------------------------------------------------------------------- token budget (actor.micro_batch_tokens)
#
# An atom is what a micro-batch boundary may not cut: one response [prompt | response] (unshared
# layout), or a whole group (shared-prompt layout: one packed sequence; or an estimator that needs
# whole groups in the loss). Its shape is (rows, width): the rows it adds to the padded [rows, width]
# tensor the forward runs on, and its widest row. A micro-batch's area is its rows x its widest row.


def cut_by_tokens(atoms: Iterable[tuple[int, int, Sequence[T]]], budget: int) -> Iterator[list[T]]:
    """The token-budget split rule: atoms (rows, width, items) in completion order, packed in
    order (next-fit) while the micro-batch's padded area stays within `budget`. A micro-batch is
    closed when the next atom would not fit, or already when not even one more row of its current
    width would (so it never waits for an atom it cannot take). Lazy, like cut_micro_batches."""
    pending: list[T] = []
    rows = width = 0
    for r, w, items in atoms:
        if r * w > budget:
            raise ValueError(f"actor.micro_batch_tokens: an atom of {r} x {w} tokens is over the budget {budget} "
                             "(a prompt over data.max_prompt_length or a response over rollout.max_new_tokens?)")
        if pending and (rows + r) * max(width, w) > budget:
            yield pending
            pending, rows, width = [], 0, 0
        pending += items
        rows, width = rows + r, max(width, w)
        if (rows + 1) * width > budget:
            yield pending
            pending, rows, width = [], 0, 0
    if pending:
        yield pending


def atoms_per_micro_batch(budget: int, bound_rows: int, bound_width: int) -> int:
    """The fewest atoms a micro-batch closed by cut_by_tokens holds (the last excepted) when no
    atom has more than `bound_rows` rows or is wider than `bound_width`: a micro-batch is closed
    only when one more atom of at most bound_rows x bound_width would overflow it, so
    (atoms + 1) x bound_rows x bound_width > budget."""
    per = budget // (bound_rows * bound_width)
    if per < 1:
        raise ValueError(f"actor.micro_batch_tokens: {budget} cannot hold one atom at its maximum size "
                         f"{bound_rows} x {bound_width} = {bound_rows * bound_width} tokens")
    return per


def num_micro_batches_by_tokens(atoms_per_rank: Sequence[int], budget: int, bound_rows: int,
                                bound_width: int) -> int:
    """Micro-steps every DP rank runs in epoch 1 under a token budget, known before any group
    arrives: the most cut_by_tokens can need on any rank (atoms_per_micro_batch), so that every
    rank starts its pipeline schedule with the same count; a rank whose responses came shorter
    fills the rest with loss-free padding micro-batches. It equals the fixed-count split whose
    micro-batches of maximum-length sequences fit the budget: the budget never runs more
    micro-steps than that, and fewer real ones when responses are short."""
    per = atoms_per_micro_batch(budget, bound_rows, bound_width)
    return max((-(-a // per) for a in atoms_per_rank), default=0)


def _sample_lengths(sample) -> tuple[int, int]:
    return len(sample.prompt_ids), len(sample.response_ids)


@dataclass(frozen=True)
class TokenBudget:
    """actor.micro_batch_tokens and the lengths that bound an atom (dp_assignment's token budget):
    `tokens` the most padded tokens (rows x widest row) of one micro-batch; `max_prompt`
    data.max_prompt_length; `max_new` rollout.max_new_tokens. `whole_groups`: a micro-batch holds
    whole groups (shared-prompt layout, or an estimator re-centring rewards in the loss)."""
    tokens: int
    max_prompt: int
    max_new: int
    shared_prompt: bool = False
    whole_groups: bool = False

    @classmethod
    def of(cls, cfg, whole_groups: bool = False) -> Optional["TokenBudget"]:
        """The Config's budget (None: actor.micro_batch_tokens unset, fixed counts)."""
        if cfg.actor.micro_batch_tokens is None:
            return None
        return cls(cfg.actor.micro_batch_tokens, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens,
                   cfg.actor.shared_prompt, whole_groups)

    def bound(self, sizes: dict[int, int]) -> tuple[int, int]:
        """(rows, width) no atom of a batch with these group sizes exceeds."""
        k = max(sizes.values(), default=1) or 1
        if self.shared_prompt:
            return 1, self.max_prompt + k * self.max_new
        return (k if self.whole_groups else 1), self.max_prompt + self.max_new

    def num_micro_batches(self, sizes: dict[int, int], owner: dict[int, int], dp_size: int) -> int:
        per_group = self.shared_prompt or self.whole_groups
        atoms = [sum((1 if k else 0) if per_group else k for g, k in sizes.items() if owner[g] == r)
                 for r in range(dp_size)]
        return num_micro_batches_by_tokens(atoms, self.tokens, *self.bound(sizes))

    def atoms(self, groups: Iterable[Sequence[T]], lengths: Callable[[T], tuple[int, int]] = _sample_lengths):
        """(rows, width, items) of each atom of `groups` (each a group's items, in completion order;
        `lengths(item)`: its (prompt, response) tokens)."""
        for items in groups:
            if not items:
                continue
            lens = [lengths(x) for x in items]
            if self.shared_prompt:
                yield 1, lens[0][0] + sum(r for _, r in lens), list(items)
            elif self.whole_groups:
                yield len(items), max(p + r for p, r in lens), list(items)
            else:
                for x, (p, r) in zip(items, lens):
                    yield 1, p + r, [x]
