"""A replay of the scheduling of training steps - sync, sync_split, periodic - with stage costs
(costs.py) instead of models: what tools/simulate.py predicts with.

The replay makes the decisions the real code makes (scheduling/plan.py, scheduling/producer.py,
rollout/worker.py, rollout/hf_engine.py, train/feed.py, train/step.py), with the runtime's own
torch-free rules where there is one (rollout/dispatch.py, scheduling/dp_assignment.py):
- the batch plan: `prompts` requests of K samples each, dispatched at the step's start to the
  engine with the fewest outstanding samples (ties: the lower engine id), samples k in order;
- each engine batches continuously (engine.py);
- one producer thread: a result reaches it `result_s` after its engine step; the group whose K-th
  response arrives is scored there (reward_call_s + reward_item_s * K) before the next result is
  read, then queued - in completion order (periodic), or all at once after the last (sync_split);
- the trainer: groups to DP ranks as the trainer assigns them; each rank packs a micro-batch
  whenever micro_batch_size of its samples are pending (or its last group arrived), starting it at
  max(previous micro-step's end + handoff_busy_s, the group's arrival + handoff_wait_s); then the
  optimizer step (after every rank's last micro-step), post_train_s, and the weight sync, which
  ends the step;
- sync (colocated): the engines generate the whole batch, it is scored in one call, then trained.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from periodic_async.rollout.dispatch import least_loaded_worker
from periodic_async.scheduling.dp_assignment import assign_groups, micro_batch_due
from periodic_async.telemetry.step_metrics import union_length

from .costs import Cluster, Costs, Workload
from .engine import Sample, replay_engine

MODES = ("sync", "sync_split", "periodic")


def dispatch(requests: list[list[Sample]], engines: int) -> list[list[Sample]]:
    """rollout/worker.py: WorkerPool.dispatch - each request to the engine with the fewest
    outstanding samples (ties: the lower id; its rule, rollout/dispatch.py); an engine's samples
    in request order."""
    load = {e: 0 for e in range(engines)}
    out: list[list[Sample]] = [[] for _ in range(engines)]
    for req in requests:
        e = least_loaded_worker(load)
        for s in req:
            s.engine = e
        out[e] += req
        load[e] += len(req)
    return out


@dataclass
class StepReplay:
    step_s: float
    gen_s: float                 # step start -> last group scored (timing_s/gen)
    train_s: float               # micro-steps + optimizer (timing_s/update_actor)
    sync_s: float
    tokens: int
    engine_busy_s: float         # mean over engines of the union of their generation
    trainer_idle_s: float        # epoch 1: waiting for groups
    events: list[dict]


def plan_requests(workload: Workload, rng: random.Random) -> list[list[Sample]]:
    reqs = []
    for g in range(workload.prompts):
        p = workload.prompt_lengths.sample(rng, 1)[0]
        reqs.append([Sample(g, k, p, r) for k, r in enumerate(workload.response_lengths.sample(rng, workload.n))])
    return reqs


def replay_step(mode: str, requests: list[list[Sample]], cluster: Cluster, costs: Costs, micro_batch_size: int,
                weight_bytes: float = 0.0, t0: float = 0.0, step: int = 1) -> StepReplay:
    """One step of `mode` from t0: returns its times and its timeline events (telemetry/timeline.py
    format, absolute times)."""
    if mode not in MODES:
        raise ValueError(f"mode '{mode}': expected one of {', '.join(MODES)}")
    c, g = costs, costs.gen
    engines = cluster.engines(mode)
    per_engine = dispatch(requests, engines)
    t_gen0 = t0 + c.dispatch_s
    events: list[dict] = []
    busy = []
    for samples in per_engine:
        its = replay_engine(samples, cluster.slots, g, t_gen0)
        busy.append(union_length([(s.start, s.end) for s in samples]))
    samples = [s for req in requests for s in req]
    for s in samples:
        events.append({"step": step, "kind": "generate", "lane": f"worker{s.engine}/slot{s.slot}", "start": s.start,
                       "end": s.end, "worker": s.engine, "slot": s.slot, "group": s.group, "sample": s.k,
                       "prompt_tokens": s.prompt, "response_tokens": s.response, "finish": "stop"})
    sizes = {req[0].group: len(req) for req in requests}
    avail: dict[int, float] = {}
    order: list[int] = []
    if mode == "sync":
        t_gen_end = max(s.end for s in samples)
        a = t_gen_end + c.result_s
        b = a + c.reward_call_s + c.reward_item_s * len(samples)
        events.append({"step": step, "kind": "reward", "lane": "trainer", "start": a, "end": b,
                       "groups": sorted(sizes), "items": len(samples)})
        order = sorted(sizes)
        avail = {gi: b for gi in order}
        gen_end, train_from = t_gen_end, b
    else:
        arrivals = sorted(samples, key=lambda s: (s.end + c.result_s, s.engine, s.group, s.k))
        count = {gi: 0 for gi in sizes}
        cursor = t0
        for s in arrivals:
            cursor = max(cursor, s.end + c.result_s)
            count[s.group] += 1
            if count[s.group] == sizes[s.group]:
                a, cursor = cursor, cursor + c.reward_call_s + c.reward_item_s * sizes[s.group]
                events.append({"step": step, "kind": "reward", "lane": "trainer", "start": a, "end": cursor,
                               "groups": [s.group], "items": sizes[s.group]})
                avail[s.group] = cursor
                order.append(s.group)
        gen_end, train_from = cursor, t0
        if mode == "sync_split":
            avail = {gi: cursor for gi in order}
    dp = cluster.dp(mode)
    owner = assign_groups(sizes, dp)
    by_group = {req[0].group: req for req in requests}
    rank_end, train_busy, wait, n_micro = [], 0.0, 0.0, 0
    for r in range(dp):
        free_at, pending = train_from, []
        remaining = sum(1 for gi in owner if owner[gi] == r)
        first = True
        for gi in order:
            if owner[gi] == r:
                remaining -= 1
                pending += by_group[gi]
            while micro_batch_due(len(pending), remaining, micro_batch_size):
                mb, pending = pending[:micro_batch_size], pending[micro_batch_size:]
                ready = avail[gi] + c.handoff_wait_s
                start = max(ready, free_at + (0.0 if first else c.handoff_busy_s))
                if r == 0:
                    wait += max(0.0, ready - (free_at + (0.0 if first else c.handoff_busy_s)))
                lens = [s.prompt + s.response for s in mb]
                width = max(lens)
                tok = len(mb) * width if c.pad else sum(lens)
                attn = len(mb) * width * width if c.pad else sum(x * x for x in lens)
                dur = c.micro_step_s + c.token_s * tok + c.attn_s * attn
                end = start + dur
                if r == 0:
                    train_busy += dur
                    events.append({"step": step, "kind": "train", "lane": "trainer", "start": start, "end": end,
                                   "index": n_micro, "sequences": len(mb),
                                   "tokens": sum(lens), "response_tokens": sum(s.response for s in mb),
                                   "padded_tokens": len(mb) * width, "groups": sorted({s.group for s in mb})})
                    n_micro += 1
                free_at, first = end, False
        rank_end.append(free_at)
    opt_start = max(rank_end)
    opt_end = opt_start + c.optimizer_s
    sync_start = opt_end + c.post_train_s
    sync_end = sync_start + c.sync_s + c.sync_byte_s * weight_bytes
    events.append({"step": step, "kind": "optimizer", "lane": "trainer", "start": opt_start, "end": opt_end})
    events.append({"step": step, "kind": "update_weights", "lane": "trainer", "start": sync_start, "end": sync_end})
    events.append({"step": step, "kind": "step", "lane": "trainer", "start": t0, "end": sync_end, "mode": mode,
                   "devices": cluster.devices(mode),
                   "engines": engines, "world": dp * cluster.tp, "dp_size": dp, "micro_batch_size": micro_batch_size,
                   "dispatch": t0, "gen_end": gen_end})
    return StepReplay(step_s=sync_end - t0, gen_s=gen_end - t0, train_s=train_busy + c.optimizer_s,
                      sync_s=sync_end - sync_start, tokens=sum(s.prompt + s.response for s in samples),
                      engine_busy_s=statistics.fmean(busy) if busy else 0.0, trainer_idle_s=wait, events=events)


@dataclass
class Prediction:
    mode: str
    steps: int
    step_s: float
    gen_s: float
    train_s: float
    sync_s: float
    tokens_per_step: float
    devices: int
    tokens_per_s_per_device: float
    rollout_idle: float
    trainer_idle: float


def simulate(mode: str, workload: Workload, cluster: Cluster, costs: Costs, steps: int = 20, seed: int = 0,
             events: list | None = None, step_gap_s: float = 0.01, plans: list | None = None) -> Prediction:
    """Mean over `steps` replayed steps: response lengths drawn afresh each step, or (plans) the
    given steps' lengths, [[prompt length, [response lengths of its K samples]] per group] per
    step, cycled."""
    rng = random.Random(seed)
    reps, t = [], 0.0
    for i in range(steps):
        if plans:
            reqs = [[Sample(g, k, p, r) for k, r in enumerate(rs)] for g, (p, rs) in enumerate(plans[i % len(plans)])]
        else:
            reqs = plan_requests(workload, rng)
        rep = replay_step(mode, reqs, cluster, costs, workload.micro_batch_size,
                          workload.weight_bytes, t0=t, step=i + 1)
        reps.append(rep)
        if events is not None:
            events += rep.events
        t += rep.step_s + step_gap_s
    step_s = statistics.fmean(r.step_s for r in reps)
    tokens = statistics.fmean(r.tokens for r in reps)
    devices = cluster.devices(mode)
    return Prediction(mode, steps, step_s, statistics.fmean(r.gen_s for r in reps),
                      statistics.fmean(r.train_s for r in reps), statistics.fmean(r.sync_s for r in reps), tokens,
                      devices, sum(r.tokens for r in reps) / sum(r.step_s for r in reps) / devices,
                      max(0.0, 1 - statistics.fmean(r.engine_busy_s / r.step_s for r in reps)),
                      statistics.fmean(r.trainer_idle_s / r.step_s for r in reps))
