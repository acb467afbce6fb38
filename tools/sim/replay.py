"""A replay of the scheduling of training steps - sync, sync_split, periodic, async - with stage
costs (costs.py) instead of models: what tools/simulate.py predicts with.

The replay makes the decisions the real code makes (scheduling/producer.py, scheduling/plan.py,
rollout/worker.py, rollout/hf_engine.py, train/feed.py, train/step.py), with the runtime's own
torch-free rules and plug-ins, imported (rollout/dispatch.py, scheduling/dp_assignment.py,
scheduling/staleness.py, scheduling/mode.py, scheduling/group_sizing.py, scheduling/allocation.py):
- the modes whose engines live in workers (sync_split, periodic, async) run through the
  event-driven producer replay (pipeline.py): dispatch by the staleness rule, continuous batching
  per engine, one reward call per poll, groups released on completion or after the batch, the
  plug-ins (planner.py), the trainer (trainer.py);
- `replay_step` replays one batch from t0 (every request dispatched at its start);
  `simulate` replays `steps` batches: one batch after the other (sync, and sync_split / periodic
  without plug-ins), or one pipeline over all of them (async, or any plug-in), where batches
  overlap as the mode's eta lets them;
- sync (colocated): the engines generate the whole batch, it is scored in one call, then trained.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from periodic_async.rollout.dispatch import least_loaded_worker  # noqa: F401 - the pool's rule, used by pipeline.py
from periodic_async.scheduling.dp_assignment import assign_groups, micro_batch_due  # noqa: F401 - trainer.py's rules
from periodic_async.scheduling.mode import Mode
from periodic_async.telemetry.step_metrics import union_length

from .costs import Cluster, Costs, Workload
from .engine import Sample, replay_engine
from .pipeline import Batch, Pipeline, pick_engine
from .planner import FixedPlan, Planner, plan_requests  # noqa: F401 - plan_requests: the replay's draw
from .trainer import train_step

MODES = ("sync", "sync_split", "periodic", "async")


def dispatch(requests: list[list[Sample]], engines: int) -> list[list[Sample]]:
    """A batch dispatched at once (pipeline.pick_engine, the pool's rule): each request to the
    engine with the fewest outstanding samples; an engine's samples in request order."""
    load = {e: 0 for e in range(engines)}
    out: list[list[Sample]] = [[] for _ in range(engines)]
    for req in requests:
        e = pick_engine(load, len(req))
        for s in req:
            s.engine = e
        out[e] += req
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
    end: float = 0.0             # absolute time of its weight sync's end


def replay_step(mode: str, requests: list[list[Sample]], cluster: Cluster, costs: Costs, micro_batch_size: int,
                weight_bytes: float = 0.0, t0: float = 0.0, step: int = 1) -> StepReplay:
    """One batch of `mode` from t0, every request dispatched at t0: returns its times and its
    timeline events (telemetry/timeline.py format, absolute times)."""
    if mode not in MODES:
        raise ValueError(f"mode '{mode}': expected one of {', '.join(MODES)}")
    if mode == "sync":
        return _replay_sync(requests, cluster, costs, micro_batch_size, weight_bytes, t0, step)
    plan = FixedPlan(requests)
    planner = type("OnePlan", (), {"plan": lambda self, s: plan, "observe": lambda self, *a: {}})()
    (b,) = Pipeline(Mode.of(mode), planner, cluster, costs, micro_batch_size, weight_bytes, step, step, t0).run()
    return batch_replay(b, mode, cluster, micro_batch_size, b.samples)


def batch_replay(b: Batch, mode: str, cluster: Cluster, micro_batch_size: int, all_samples: list[Sample]) -> StepReplay:
    """A replayed batch as a step: from the trainer's start on it (b.t0) to its weight sync's end;
    its engines' busy time is their generation (of any batch) within that window."""
    engines, dp = cluster.engines(mode), cluster.dp(mode)
    events = [{"step": b.step, "kind": "generate", "lane": f"worker{s.engine}/slot{s.slot}", "start": s.start,
               "end": s.end, "worker": s.engine, "slot": s.slot, "group": s.group, "sample": s.k,
               "prompt_tokens": s.prompt, "response_tokens": s.response, "finish": "stop"} for s in b.samples]
    events += b.events
    events.append({"step": b.step, "kind": "step", "lane": "trainer", "start": b.t0, "end": b.sync_end, "mode": mode,
                   "devices": cluster.devices(mode), "engines": engines, "world": dp * cluster.tp, "dp_size": dp,
                   "micro_batch_size": micro_batch_size, "dispatch": b.dispatch, "gen_end": b.gen_end})
    busy = [union_length([(max(s.start, b.t0), min(s.end, b.sync_end)) for s in all_samples
                          if s.engine == e and s.end > b.t0 and s.start < b.sync_end]) for e in range(engines)]
    sync = [e for e in b.events if e["kind"] == "update_weights"][0]
    return StepReplay(step_s=b.sync_end - b.t0, gen_s=b.gen_end - b.dispatch, train_s=b.train_s,
                      sync_s=sync["end"] - sync["start"], tokens=sum(s.prompt + s.response for s in b.samples),
                      engine_busy_s=statistics.fmean(busy) if busy else 0.0, trainer_idle_s=b.trainer_idle_s,
                      events=events, end=b.sync_end)


def _replay_sync(requests: list[list[Sample]], cluster: Cluster, costs: Costs, micro_batch_size: int,
                 weight_bytes: float, t0: float, step: int) -> StepReplay:
    """sync (colocated): the engines generate the whole batch, it is scored in one call, then trained."""
    c, g = costs, costs.gen
    engines = cluster.engines("sync")
    per_engine = dispatch(requests, engines)
    busy = []
    for samples in per_engine:
        replay_engine(samples, cluster.slots, g, t0 + c.dispatch_s)
        busy.append(union_length([(s.start, s.end) for s in samples]))
    samples = [s for req in requests for s in req]
    events = [{"step": step, "kind": "generate", "lane": f"worker{s.engine}/slot{s.slot}", "start": s.start,
               "end": s.end, "worker": s.engine, "slot": s.slot, "group": s.group, "sample": s.k,
               "prompt_tokens": s.prompt, "response_tokens": s.response, "finish": "stop"} for s in samples]
    sizes = {req[0].group: len(req) for req in requests}
    gen_end = max(s.end for s in samples)
    a = gen_end + c.result_s
    t_scored = a + c.reward_call_s + c.reward_item_s * len(samples)
    events.append({"step": step, "kind": "reward", "lane": "trainer", "start": a, "end": t_scored,
                   "groups": sorted(sizes), "items": len(samples)})
    order = sorted(sizes)
    tr = train_step(order, {gi: t_scored for gi in order}, {req[0].group: req for req in requests}, sizes,
                    cluster.dp("sync"), t_scored, c, micro_batch_size, weight_bytes, step)
    events += tr.events
    dp = cluster.dp("sync")
    events.append({"step": step, "kind": "step", "lane": "trainer", "start": t0, "end": tr.sync_end, "mode": "sync",
                   "devices": cluster.devices("sync"), "engines": engines, "world": dp * cluster.tp, "dp_size": dp,
                   "micro_batch_size": micro_batch_size, "dispatch": t0, "gen_end": gen_end})
    return StepReplay(step_s=tr.sync_end - t0, gen_s=gen_end - t0, train_s=tr.train_busy_s,
                      sync_s=tr.sync_end - tr.sync_start, tokens=sum(s.prompt + s.response for s in samples),
                      engine_busy_s=statistics.fmean(busy) if busy else 0.0, trainer_idle_s=tr.wait_s, events=events,
                      end=tr.sync_end)


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
    wall_s: float = 0.0               # first dispatch -> last weight sync's end
    rollouts_per_step: float = 0.0    # samples generated per step (pilots, commits, backfills, dropped groups)
    eta: int = 0
    batches: list | None = None       # the pipeline's Batch records (async, plug-ins), else None


def simulate(mode: str, workload: Workload, cluster: Cluster, costs: Costs, steps: int = 20, seed: int = 0,
             events: list | None = None, step_gap_s: float = 0.01, plans: list | None = None, eta: int = 0,
             sizer=None, allocator=None, prompts=None) -> Prediction:
    """Mean over `steps` replayed steps: response lengths drawn afresh each step, or (plans) the
    given steps' lengths, [[prompt length, [response lengths of its K samples]] per group] per
    step, cycled. `eta`: async's max_staleness; `sizer`: a runtime group sizer (group_sizing.py);
    `allocator` (allocation.py Allocator) with `prompts` (planner.PromptSet): selection."""
    m = Mode.of(mode, eta)
    plugins = sizer is not None or allocator is not None
    if plugins and not m.engine_in_workers:
        raise ValueError("the plug-ins are replayed in the modes whose engines live in workers, not sync")
    rng = random.Random(seed)
    if mode == "async" or plugins:
        planner = Planner(workload, rng, sizer, allocator, prompts, plans)
        batches = Pipeline(m, planner, cluster, costs, workload.micro_batch_size, workload.weight_bytes, 1, steps,
                           0.0, step_gap_s).run()
        every = [s for b in batches for s in b.samples]
        reps = [batch_replay(b, mode, cluster, workload.micro_batch_size, every) for b in batches]
    else:
        batches, reps, t = None, [], 0.0
        for i in range(steps):
            if plans:
                reqs = [[Sample(g, k, p, r) for k, r in enumerate(rs)]
                        for g, (p, rs) in enumerate(plans[i % len(plans)])]
            else:
                reqs = plan_requests(workload, rng)
            rep = replay_step(mode, reqs, cluster, costs, workload.micro_batch_size, workload.weight_bytes, t0=t,
                              step=i + 1)
            reps.append(rep)
            t = rep.end + step_gap_s
    if events is not None:
        for r in reps:
            events += r.events
    step_s = statistics.fmean(r.step_s for r in reps)
    tokens = statistics.fmean(r.tokens for r in reps)
    devices = cluster.devices(mode)
    rollouts = statistics.fmean(sum(1 for e in r.events if e["kind"] == "generate") for r in reps)
    return Prediction(mode, steps, step_s, statistics.fmean(r.gen_s for r in reps),
                      statistics.fmean(r.train_s for r in reps), statistics.fmean(r.sync_s for r in reps), tokens,
                      devices, sum(r.tokens for r in reps) / sum(r.step_s for r in reps) / devices,
                      max(0.0, 1 - statistics.fmean(r.engine_busy_s / r.step_s for r in reps)),
                      statistics.fmean(r.trainer_idle_s / r.step_s for r in reps), reps[-1].end, rollouts, eta,
                      batches)
