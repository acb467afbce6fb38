"""A deterministic driver of the pilot-commit allocator that records every decision, for the
test that the v0 settings (`PilotConfig.v0`) decide exactly as the allocator did before the
official-semantics change (tests/data/pilot_v0_trace.json, recorded at commit 4fa040d with this
driver and that commit's `PilotConfig(p_lower, p_upper)`).

Only the allocator's public API of both versions is used, so the same file drives either one;
`make_pilot(n_pilot, p_lower, p_upper, **rest)` builds the configuration of the version in use.
"""
from __future__ import annotations

import random

from periodic_async.config.allocation import BackfillConfig
from periodic_async.data.dataset import PromptLoader
from periodic_async.data.records import PromptRecord
from periodic_async.scheduling.allocation import Allocator, Candidate

NUM_PROMPTS = 12


def _draw(loader):
    def draw():
        epoch = loader.epoch
        (record,) = loader.next_batch(1)
        return Candidate(record.index, epoch)
    return draw


def scenario(seed: int) -> dict:
    """The random settings of one traced run (seed -> a batch size, K, n_pilot, thresholds ...)."""
    rng = random.Random(seed)
    batch, k = rng.randint(1, 4), rng.randint(3, 7)
    n_pilot = rng.randint(2, k - 1)
    lo = rng.randint(0, n_pilot - 2)
    hi = rng.randint(lo + 2, n_pilot)
    candidates = rng.randint(1, 2 * batch)
    budget = rng.randint(candidates * n_pilot + k - n_pilot, 2 * candidates * k)
    return dict(batch=batch, k=k, n_pilot=n_pilot, p_lower=lo / n_pilot, p_upper=hi / n_pilot, budget=budget,
                num_candidates=candidates, replay_max_age=rng.randint(0, 3),
                success_threshold=rng.choice([0.5, 1.0]), success_rate=[rng.random() for _ in range(NUM_PROMPTS)],
                salt=rng.randrange(10 ** 6), order_seed=seed + 1000)


def trace(seed: int, make_pilot, steps: int = 8) -> list:
    """Every step's requests (in dispatch order), trained groups, metrics and the allocator's
    state after the step, as JSON-able lists."""
    sc = scenario(seed)
    cfg = make_pilot(sc["n_pilot"], sc["p_lower"], sc["p_upper"], budget=sc["budget"],
                     num_candidates=sc["num_candidates"], replay_max_age=sc["replay_max_age"],
                     success_threshold=sc["success_threshold"])
    loader = PromptLoader([PromptRecord(f"{i}=", str(i), i) for i in range(NUM_PROMPTS)], batch_size=sc["batch"],
                          seed=seed)
    alloc = Allocator(cfg, BackfillConfig(), batch_size=sc["batch"], group_size=sc["k"], num_prompts=NUM_PROMPTS)
    order = random.Random(sc["order_seed"])

    def reward(step, key, sample):
        u = random.Random(hash((sc["salt"], step, key, sample)) & 0xFFFFFFFF).random()
        return 1.0 if u < sc["success_rate"][key] else (0.5 if u < 0.9 else 0.0)

    out = []
    for step in range(steps):
        pending = list(alloc.begin_step(step, _draw(loader)))
        requests = [[r.slot, r.key, r.phase, list(r.sample_indices)] for r in pending]
        groups = []
        while pending:
            req = pending.pop(order.randrange(len(pending)))
            o = alloc.on_group(step, req.slot, req.phase, [reward(step, req.key, i) for i in req.sample_indices])
            pending += o.requests
            requests += [[r.slot, r.key, r.phase, list(r.sample_indices)] for r in o.requests]
            groups += [[g.slot, g.key, list(g.rewards)] for g in o.ready]
        metrics = alloc.end_step(step)
        out.append({"requests": requests, "groups": groups, "metrics": metrics, "state": alloc.state_dict()})
    return out


if __name__ == "__main__":      # records the golden trace with the code in use (the v0 allocator)
    import json
    import sys

    from periodic_async.config.allocation import PilotConfig

    def v0(n_pilot, p_lower, p_upper, **rest):
        return PilotConfig(enabled=True, n_pilot=n_pilot, p_lower=p_lower, p_upper=p_upper, **rest)
    json.dump({str(s): trace(s, v0) for s in range(60)}, open(sys.argv[1], "w"), sort_keys=True)
