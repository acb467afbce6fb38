"""A replay of the scheduling of one training step - sync, sync_split, periodic - with stage costs
instead of models: what tools/simulate.py calibrates on measured runs and predicts with, and what
tools/profile_run.py takes its FLOP formulas from. Torch-free (numpy only for the fits).

The replay makes the decisions the real code makes (scheduling/plan.py, scheduling/producer.py,
rollout/worker.py, rollout/hf_engine.py, train/feed.py, train/step.py):
- the batch plan: `prompts` requests of K samples each, dispatched at the step's start to the
  engine with the fewest outstanding samples (ties: the lower engine id), samples k in order;
- an engine batches continuously with `slots` slots, the lowest free slot first; two engine
  models: `incremental` (hf_engine.py today and vLLM: a finished sequence leaves at once, only
  the newcomers are prefilled, each distinct prompt once) and `reprefill` (hf_engine.py up to
  bc37220: any admission re-prefills the whole active set, finished rows stay in the decode batch
  until then); an engine step costs
      decode_s + decode_row_s * rows + decode_ctx_s * context tokens of the rows     (decode)
    + prefill_s + prefill_row_s * rows + prefill_token_s * tokens prefilled          (prefill)
    + finish_s * sequences finished (their results sent);
- one producer thread: a result reaches it `result_s` after its engine step; the group whose K-th
  response arrives is scored there (reward_call_s + reward_item_s * K) before the next result is
  read, then queued - in completion order (periodic), or all at once after the last (sync_split);
- the trainer: groups to DP ranks by scheduling/dp_assignment.py (the trainer's own rule); each rank packs a micro-batch
  whenever micro_batch_size of its samples are pending (or its last group arrived), starting it at
  max(previous micro-step's end + handoff_busy_s, the group's arrival + handoff_wait_s); a micro-step
  costs micro_step_s + token_s * tokens (padded to the longest row) + attn_s * rows * width^2;
  then the optimizer step (optimizer_s, after every rank's last micro-step), post_train_s, and the
  weight sync (sync_s + sync_byte_s * bytes), which ends the step;
- sync (colocated): the engines generate the whole batch, it is scored in one call, then trained.
Model FLOPs (profile_run.py, the hardware projection): a forward over S tokens is
2 N S + 2 L d S (S + 1) (N: matmul parameters incl. the LM head, L layers, d = heads x head_dim;
causal attention, QK^T and AV); generating a response of R tokens after a prompt of P runs the
model over P + R - 1 tokens; training a sample runs 3 forwards' worth (forward + backward) of the
policy over its P + R tokens, plus one forward of the reference (and of the old policy when
ppo_epochs > 1) per epoch.
"""
from __future__ import annotations

import heapq
import json
import math
import os
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, fields

from ..telemetry.step_metrics import union_length
from ..rollout.dispatch import least_loaded_worker
from .dp_assignment import assign_groups, micro_batch_due

MODES = ("sync", "sync_split", "periodic")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------- model shape and FLOPs
@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = True

    @classmethod
    def from_hf_config(cls, c: dict) -> "ModelShape":
        heads = c["num_attention_heads"]
        return cls(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads, ffn=c["intermediate_size"],
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=c.get("model_type", "qwen2") == "qwen2")

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    def _layer_matmul(self) -> int:
        h, q, kv = self.hidden, self.attn_dim, self.kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.ffn

    @property
    def matmul_params(self) -> int:
        """Parameters that multiply every token: the layers' linear weights and the LM head."""
        return self.layers * self._layer_matmul() + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        bias = (self.attn_dim + 2 * self.kv_heads * self.head_dim) if self.qkv_bias else 0
        layer = self._layer_matmul() + bias + 2 * self.hidden
        return self.layers * layer + self.hidden + self.vocab * self.hidden * (1 if self.tied else 2)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def forward_flops(shape: ModelShape, tokens: int) -> float:
    """One causal forward over `tokens` positions: 2 N S (matmuls) + 2 L d S (S + 1) (attention)."""
    s = max(0, tokens)
    return 2.0 * shape.matmul_params * s + 2.0 * shape.layers * shape.attn_dim * s * (s + 1)


def generation_flops(shape: ModelShape, prompt: int, response: int) -> float:
    """Prefill of the prompt and decode of the response: the model runs over P + R - 1 tokens
    (the last sampled token is never fed back)."""
    return forward_flops(shape, prompt + response - 1)


def training_flops(shape: ModelShape, prompt: int, response: int, ppo_epochs: int = 1, reference: bool = True,
                   old_shortcut: bool = True) -> float:
    """The tri-model step over one sample of P + R tokens: per epoch the policy's forward and
    backward (3 forwards' worth) and the reference's forward; the old policy's forward in epochs
    2.. (and in epoch 1 too without the shortcut)."""
    f = forward_flops(shape, prompt + response)
    old = ppo_epochs - 1 if old_shortcut else ppo_epochs
    return f * (3 * ppo_epochs + (ppo_epochs if reference else 0) + old)


# ---------------------------------------------------------------------- response lengths
class Lengths:
    """A response-length (or prompt-length) distribution: sample(rng, n) -> n ints >= 1."""
    spec = ""

    def sample(self, rng: random.Random, n: int) -> list[int]:
        raise NotImplementedError

    def mean(self, rng_seed: int = 0, n: int = 20000) -> float:
        return statistics.fmean(self.sample(random.Random(rng_seed), n))


class FixedLengths(Lengths):
    def __init__(self, value: int):
        self.value = int(value)
        self.spec = f"fixed:{self.value}"

    def sample(self, rng, n):
        return [self.value] * n


class EmpiricalLengths(Lengths):
    def __init__(self, values: list[int], label: str = "empirical"):
        if not values:
            raise ValueError("empirical lengths: no values")
        self.values = [int(v) for v in values]
        self.spec = f"{label} ({len(self.values)} values, mean {statistics.fmean(self.values):.2f})"

    def sample(self, rng, n):
        return [rng.choice(self.values) for _ in range(n)]


class LogNormalLengths(Lengths):
    def __init__(self, median: float, sigma: float, cap: int, floor: int = 1):
        self.median, self.sigma, self.cap, self.floor = median, sigma, int(cap), int(floor)
        self.spec = f"lognormal:median={median:g},sigma={sigma:g},cap={self.cap}"

    def sample(self, rng, n):
        mu = math.log(self.median)
        return [min(self.cap, max(self.floor, int(round(rng.lognormvariate(mu, self.sigma))))) for _ in range(n)]


class ParetoLengths(Lengths):
    """Long-tailed: xm * Pareto(alpha), capped."""

    def __init__(self, xm: float, alpha: float, cap: int):
        self.xm, self.alpha, self.cap = xm, alpha, int(cap)
        self.spec = f"pareto:xm={xm:g},alpha={alpha:g},cap={self.cap}"

    def sample(self, rng, n):
        return [min(self.cap, max(1, int(round(self.xm * rng.paretovariate(self.alpha))))) for _ in range(n)]


def parse_lengths(spec: str) -> Lengths:
    """fixed:N | lognormal:MEDIAN,SIGMA,CAP | pareto:XM,ALPHA,CAP | empirical:RUN_DIR[,RUN_DIR...]
    (the response lengths of the runs' timelines) | empirical-prompt:RUN_DIR (their prompt lengths)."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        return FixedLengths(int(arg))
    if kind == "lognormal":
        m, s, cap = arg.split(",")
        return LogNormalLengths(float(m), float(s), int(cap))
    if kind == "pareto":
        xm, a, cap = arg.split(",")
        return ParetoLengths(float(xm), float(a), int(cap))
    if kind in ("empirical", "empirical-prompt"):
        key = "response_tokens" if kind == "empirical" else "prompt_tokens"
        values = []
        for d in arg.split(","):
            values += [e[key] for e in read_timeline(d) if e["kind"] == "generate" and key in e]
        return EmpiricalLengths(values, label=f"{kind}:{arg}")
    raise ValueError(f"lengths '{spec}': expected fixed:N, lognormal:MEDIAN,SIGMA,CAP, pareto:XM,ALPHA,CAP "
                     "or empirical:RUN_DIR")


# ---------------------------------------------------------------------- costs and the cluster
GEN_FEATURES = ("decode_s", "decode_row_s", "decode_ctx_s", "prefill_s", "prefill_row_s", "prefill_token_s",
                "finish_s")


@dataclass
class GenCosts:
    """One rollout engine (device): seconds per engine step, by what the step holds."""
    decode_s: float = 0.0           # a decode forward
    decode_row_s: float = 0.0       # per sequence in it
    decode_ctx_s: float = 0.0       # per context token of its sequences (KV reads)
    prefill_s: float = 0.0          # a prefill forward
    prefill_row_s: float = 0.0      # per sequence prefilled
    prefill_token_s: float = 0.0    # per token prefilled
    finish_s: float = 0.0           # per finished sequence (its result sent)
    engine: str = "incremental"     # incremental | reprefill (see the module docstring)
    share_prompt: bool = True       # incremental: a prompt shared by several newcomers is prefilled once

    def step_s(self, f: list[float]) -> float:
        return sum(getattr(self, k) * v for k, v in zip(GEN_FEATURES, f))


@dataclass
class Costs:
    gen: GenCosts = field(default_factory=GenCosts)
    # training, per DP rank (one rank = a TP group of devices)
    micro_step_s: float = 0.0
    token_s: float = 0.0
    attn_s: float = 0.0             # per row x width^2 of a micro-batch
    pad: bool = True                # micro-batches are padded to their longest row (unshared packing)
    optimizer_s: float = 0.0
    # the rest of the step
    reward_call_s: float = 0.0
    reward_item_s: float = 0.0
    sync_s: float = 0.0
    sync_byte_s: float = 0.0
    dispatch_s: float = 0.0         # step start -> the engines start
    result_s: float = 0.0           # engine step end -> the producer has the result
    handoff_busy_s: float = 0.0     # previous micro-step end -> next start, when its group was there
    handoff_wait_s: float = 0.0     # group scored -> its micro-step starts, when the trainer waited
    post_train_s: float = 0.0       # optimizer end -> weight sync start

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        d = dict(d)
        gen = GenCosts(**{k: v for k, v in d.pop("gen", {}).items() if k in {f.name for f in fields(GenCosts)}})
        return cls(gen=gen, **{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})


@dataclass
class Cluster:
    """split modes: `rollout_devices` engines with `slots` slots each, `trainer_devices` trainer
    devices in DP ranks of `tp`; sync: `colocated_engines` engines (default: one per device) and
    the trainer on all `trainer_devices + rollout_devices` devices unless `colocated_devices`."""
    rollout_devices: int = 1
    trainer_devices: int = 1
    slots: int = 32
    tp: int = 1
    colocated_devices: int | None = None
    colocated_engines: int | None = None

    def devices(self, mode: str) -> int:
        if mode == "sync":
            if self.colocated_devices is not None:
                return self.colocated_devices
            return self.trainer_devices + self.rollout_devices
        return self.trainer_devices + self.rollout_devices

    def engines(self, mode: str) -> int:
        if mode == "sync":
            return self.colocated_engines if self.colocated_engines is not None else self.devices(mode)
        return self.rollout_devices

    def dp(self, mode: str) -> int:
        devices = self.devices(mode) if mode == "sync" else self.trainer_devices
        return max(1, devices // self.tp)


@dataclass
class Workload:
    prompts: int
    n: int
    response_lengths: Lengths
    prompt_lengths: Lengths
    micro_batch_size: int
    weight_bytes: float = 0.0


# ---------------------------------------------------------------------- the replay
@dataclass
class Sample:
    group: int
    k: int
    prompt: int
    response: int
    engine: int = 0
    slot: int = -1
    start: float = 0.0
    end: float = 0.0
    done_gen: int = 0


@dataclass
class Iteration:
    """One engine step: its cost features (GEN_FEATURES order), who joined at its start and who
    finished at its end."""
    features: list[float]
    joined: list[Sample]
    finished: list[Sample]


def replay_engine(samples: list[Sample], slots: int, gen: GenCosts, t0: float = 0.0) -> list[Iteration]:
    """Continuous batching of `samples` (in admission order, all waiting at t0) on one engine;
    fills each sample's slot, start and end, returns the engine steps. The structure (who joins
    and finishes when) does not depend on the costs: all requests arrive at once."""
    if gen.engine != "reprefill":
        return _replay_incremental(samples, slots, gen, t0)
    pending = deque(samples)
    free = list(range(slots))
    heapq.heapify(free)
    its: list[Iteration] = []
    t = t0
    rows: list[Sample] = []           # the decode batch (reprefill: since the last prefill, done rows too)
    live: list[Sample] = []           # unfinished, holding a slot
    need_prefill = True
    for s in samples:
        s.done_gen = 0
    while pending or live:
        joined = []
        while pending and free:
            s = pending.popleft()
            s.slot, s.start = heapq.heappop(free), t
            joined.append(s)
        f = [0.0] * len(GEN_FEATURES)
        live = live + joined
        if joined or need_prefill:
            rows = list(live)
            f[3], f[4], f[5] = 1, len(rows), sum(s.prompt + s.done_gen for s in rows)
            need_prefill = False
        else:
            f[0], f[1], f[2] = 1, len(rows), sum(s.prompt + s.done_gen for s in rows)
        stepping = [s for s in rows if s.done_gen < s.response]
        t += gen.step_s(f)
        finished = []
        for s in stepping:
            s.done_gen += 1
            if s.done_gen >= s.response:
                s.end = t
                finished.append(s)
        if finished:
            done = set(map(id, finished))
            live = [s for s in live if id(s) not in done]
            for s in finished:
                heapq.heappush(free, s.slot)
            f[6] = len(finished)
            t += gen.finish_s * len(finished)
        if all(s.done_gen >= s.response for s in rows):
            need_prefill = True
        its.append(Iteration(f, joined, finished))
    return its


def _replay_incremental(samples: list[Sample], slots: int, gen: GenCosts, t0: float) -> list[Iteration]:
    """replay_engine for the incremental engine, in O(finishes log n) per step: a sample admitted
    at step a has generated `it - a` tokens at the start of step `it` and finishes at step
    a + R - 1."""
    pending = deque(samples)
    free = list(range(slots))
    heapq.heapify(free)
    its: list[Iteration] = []
    heap: list[tuple[int, int, Sample]] = []
    t, it, seq = t0, 0, 0
    live = prompt_sum = admit_sum = 0
    while pending or live:
        joined = []
        while pending and free:
            s = pending.popleft()
            s.slot, s.start = heapq.heappop(free), t
            joined.append(s)
        f = [0.0] * len(GEN_FEATURES)
        if live:
            f[0], f[1], f[2] = 1, live, prompt_sum + live * it - admit_sum
        if joined:
            f[3], f[4] = 1, len(joined)
            f[5] = (sum({s.group: s.prompt for s in joined}.values()) if gen.share_prompt
                    else sum(s.prompt for s in joined))
            for s in joined:
                heapq.heappush(heap, (it + s.response - 1, seq, s))
                seq += 1
                live, prompt_sum, admit_sum = live + 1, prompt_sum + s.prompt, admit_sum + it
        t += gen.step_s(f)
        finished = []
        while heap and heap[0][0] <= it:
            a_it, _, s = heapq.heappop(heap)
            s.end, s.done_gen = t, s.response
            finished.append(s)
            live, prompt_sum, admit_sum = live - 1, prompt_sum - s.prompt, admit_sum - (a_it - s.response + 1)
            heapq.heappush(free, s.slot)
        if finished:
            f[6] = len(finished)
            t += gen.finish_s * len(finished)
        its.append(Iteration(f, joined, finished))
        it += 1
    return its


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


# ---------------------------------------------------------------------- reading runs
def read_timeline(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "timeline.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no timeline (run with trainer.record_timeline=true)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_config(run_dir: str) -> dict:
    import yaml
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def model_shape_of_run(run_dir: str, config: dict | None = None) -> tuple[ModelShape | None, str]:
    """The run's model: config.json of model.path, of run_dir/model_init (the tiny model), or
    the built-in table (models/known.py) by model.path's name."""
    config = read_config(run_dir) if config is None else config
    path = (config.get("model") or {}).get("path")
    for d in ([path] if path else []) + [os.path.join(run_dir, "model_init")]:
        cj = os.path.join(d, "config.json")
        if os.path.exists(cj):
            with open(cj) as f:
                return ModelShape.from_hf_config(json.load(f)), cj
    if path:
        from ..models.known import known_hf_config
        known = known_hf_config(path)
        if known is not None:
            return ModelShape.from_hf_config(known[1]), f"built-in {known[0]}"
    return None, "unknown (no config.json found)"


def steps_of(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        out.setdefault(e["step"], []).append(e)
    return out


# ---------------------------------------------------------------------- calibration
def nnls(A, b, max_iter: int = 500):
    """min ||A x - b|| subject to x >= 0 (Lawson-Hanson), columns scaled to unit norm first."""
    import numpy as np
    A, b = np.asarray(A, float), np.asarray(b, float)
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale
    n = As.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    w = As.T @ (b - As @ x)
    it = 0
    while (~passive).any() and w[~passive].max() > 1e-12 and it < max_iter:
        it += 1
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
        w = As.T @ (b - As @ x)
    return x / scale


def _engine_observations(samples_ev: list[dict], slots: int, engine: str, share_prompt: bool = True):
    """Rows (feature differences, time difference) between consecutive observed stamps of one
    engine in one step: the replay gives the structure, the events its times. Also the share of
    samples whose slot the replay assigns as observed (1.0 when the engine model's admission order
    matches)."""
    evs = sorted(samples_ev, key=lambda e: (e["group"], e["sample"]))
    samples = [Sample(e["group"], e["sample"], e["prompt_tokens"], e["response_tokens"]) for e in evs]
    its = replay_engine(samples, slots, GenCosts(engine=engine, share_prompt=share_prompt))
    match = statistics.fmean(s.slot == e["slot"] for s, e in zip(samples, evs))
    obs_of = {id(s): e for s, e in zip(samples, evs)}
    cum = [0.0] * len(GEN_FEATURES)
    stamps = []      # (cumulative features at the stamp, observed time), in the engine's order
    for it in its:
        if it.joined:
            stamps.append((list(cum), statistics.fmean(obs_of[id(s)]["start"] for s in it.joined)))
        after = [a + b for a, b in zip(cum, it.features)]
        if it.finished:
            at_end = list(after)
            at_end[6] -= len(it.finished)         # the end stamp is taken before the results are sent
            stamps.append((at_end, statistics.fmean(obs_of[id(s)]["end"] for s in it.finished)))
        cum = after
    rows = [([b - a for a, b in zip(f0, f1)], t1 - t0) for (f0, t0), (f1, t1) in zip(stamps, stamps[1:])]
    return rows, match


def fit_generation(steps: list[list[dict]], slots: int, engine_model: str = "auto") -> tuple[GenCosts, dict]:
    """GenCosts from the generate events of the given steps (each a step's events). engine_model
    auto: both engine models are fitted and reprefill kept only if its rms residual is under 0.8
    of incremental's (on a loaded machine the residuals are mostly noise, and both models admit
    the same samples to the same slots, so the slots do not tell them apart)."""
    import numpy as np
    fits = {}
    for engine in (("incremental", "reprefill") if engine_model == "auto" else (engine_model,)):
        rows, matches = [], []
        for evs in steps:
            by_engine: dict[int, list[dict]] = {}
            for e in evs:
                if e["kind"] == "generate":
                    by_engine.setdefault(e.get("worker", 0), []).append(e)
            for samples in by_engine.values():
                if any("response_tokens" not in e for e in samples):
                    raise ValueError("the timeline has no per-sample token counts (recorded before they were added)")
                r, m = _engine_observations(samples, slots, engine)
                rows += r
                matches.append(m)
        A = np.array([r[0] for r in rows])
        b = np.array([r[1] for r in rows])
        x = nnls(A, b)
        # non-negative least squares has no free intercept: its residuals need not average zero.
        # Scale the fit so that the fitted stamp intervals add up to the observed ones.
        if len(b) and float((A @ x).sum()) > 0:
            x = x * float(b.sum()) / float((A @ x).sum())
        resid = float(np.sqrt(np.mean((A @ x - b) ** 2))) if len(b) else float("inf")
        total = float(b.sum())
        fits[engine] = (resid, engine, x, statistics.fmean(matches) if matches else 0.0, len(b), total,
                        float((A @ x).sum()))
    if len(fits) == 1:
        (best,) = fits.values()
    else:
        best = fits["reprefill"] if fits["reprefill"][0] < 0.8 * fits["incremental"][0] else fits["incremental"]
    resid, engine, x, match, n, total, fitted = best
    gen = GenCosts(**dict(zip(GEN_FEATURES, map(float, x))), engine=engine)
    return gen, {"engine": engine, "rms_residual_s": resid, "observations": n, "slot_match": match,
                 "observed_s": total, "fitted_s": fitted,
                 "rms_residual_by_engine_s": {k: v[0] for k, v in fits.items()}}


def calibrate_mode(runs: list[dict], warmup: int = 2, engine_model: str = "auto") -> dict:
    """Costs of one mode from its runs: each run {"dir", "config", "events", "metrics"}."""
    import numpy as np
    cfg = runs[0]["config"]
    mode = cfg["trainer"]["mode"]
    slots = cfg["rollout"]["max_slots"]
    steps = []
    for run in runs:
        for s, evs in sorted(steps_of(run["events"]).items()):
            if s > warmup and any(e["kind"] == "step" for e in evs):
                steps.append(evs)
    if not steps:
        raise ValueError(f"{runs[0]['dir']}: no step after the warm-up ({warmup}) has a step event in its timeline")
    gen, gen_diag = fit_generation(steps, slots, engine_model)
    c = Costs(gen=gen)
    tr = [e for evs in steps for e in evs if e["kind"] == "train" and "padded_tokens" in e]
    if tr:
        A = np.array([[1.0, e["padded_tokens"], e["padded_tokens"] ** 2 / e["sequences"]] for e in tr])
        b = np.array([e["end"] - e["start"] for e in tr])
        c.micro_step_s, c.token_s, c.attn_s = map(float, nnls(A, b))
    rw = [e for evs in steps for e in evs if e["kind"] == "reward"]
    if rw:
        A = np.array([[1.0, e["items"]] for e in rw])
        c.reward_call_s, c.reward_item_s = map(float, nnls(A, np.array([e["end"] - e["start"] for e in rw])))
    disp, res, handoffs, opt, post, sync = [], [], [], [], [], []
    for evs in steps:
        k = {}
        for e in evs:
            k.setdefault(e["kind"], []).append(e)
        st = k["step"][0]
        gens = k.get("generate", [])
        disp.append(min(e["start"] for e in gens) - st["start"])
        last_end: dict[int, float] = {}
        for e in gens:
            last_end[e["group"]] = max(last_end.get(e["group"], -1e18), e["end"])
        rewards = sorted(k.get("reward", []), key=lambda e: e["start"])
        prev = -1e18
        avail = {}
        for e in rewards:
            ready = max(last_end[gi] for gi in e["groups"])
            if ready >= prev:                       # the producer was idle: pure latency
                res.append(e["start"] - ready)
            prev = e["end"]
            for gi in e["groups"]:
                avail[gi] = e["end"]
        if mode == "sync_split" and rewards:
            avail = {gi: rewards[-1]["end"] for gi in avail}
        free_at = None
        for e in sorted(k.get("train", []), key=lambda e: e["start"]):
            ready = max(avail.get(gi, st["start"]) for gi in e.get("groups", [])) if e.get("groups") else st["start"]
            handoffs.append((free_at, ready, e["start"]))
            free_at = e["end"]
        for e in k.get("optimizer", []):
            opt.append(e["end"] - e["start"])
        for e in k.get("update_weights", []):
            sync.append(e["end"] - e["start"])
            if k.get("optimizer"):
                post.append(e["start"] - k["optimizer"][0]["end"])
    mean = lambda xs: float(statistics.fmean(xs)) if xs else 0.0    # noqa: E731
    c.dispatch_s, c.result_s = mean(disp), mean(res)
    c.handoff_busy_s, c.handoff_wait_s = _fit_handoff(handoffs)
    c.optimizer_s, c.post_train_s, c.sync_s = mean(opt), mean(post), mean(sync)
    mets = [m for run in runs for m in run["metrics"] if m.get("step", 0) > warmup and "timing_s/step" in m]
    gens = [e for evs in steps for e in evs if e["kind"] == "generate"]
    plans = []
    for evs in steps:
        groups: dict[int, dict[int, dict]] = {}
        for e in evs:
            if e["kind"] == "generate":
                groups.setdefault(e["group"], {})[e["sample"]] = e
        plans.append([[g[0]["prompt_tokens"] if 0 in g else next(iter(g.values()))["prompt_tokens"],
                       [g[k]["response_tokens"] for k in sorted(g)]] for _, g in sorted(groups.items())])
    st0 = [e for e in steps[0] if e["kind"] == "step"][0]
    return {
        "mode": mode, "runs": [r["dir"] for r in runs], "warmup": warmup, "steps": len(steps),
        "costs": c.to_dict(), "diagnostics": {"generation": gen_diag, "train_micro_steps": len(tr),
                                              "reward_calls": len(rw)},
        "workload": {"prompts": cfg["data"]["train_batch_size"], "n": cfg["rollout"]["n"],
                     "micro_batch_size": cfg["actor"]["micro_batch_size"], "slots": slots,
                     "response_lengths": [e["response_tokens"] for e in gens],
                     "prompt_lengths": [e["prompt_tokens"] for e in gens], "steps": plans},
        "cluster": {"engines": st0.get("engines", 1), "devices": st0.get("devices", 1), "world": st0.get("world", 1),
                    "dp_size": st0.get("dp_size", 1)},
        "measured": {"step_s": mean([m["timing_s/step"] for m in mets]),
                     # as the prediction's: all tokens over all step time (not a mean of per-step ratios)
                     "tokens_per_s_per_device": sum(m["perf/total_num_tokens"] for m in mets)
                     / sum(m["timing_s/step"] for m in mets) / st0.get("devices", 1) if mets else 0.0,
                     "perf_throughput_mean": mean([m["perf/throughput"] for m in mets]),
                     "gen_s": mean([m["timing_s/gen"] for m in mets]),
                     "train_s": mean([m["timing_s/update_actor"] for m in mets]), "steps": len(mets)},
    }


def _fit_handoff(rows) -> tuple[float, float]:
    """(handoff_busy_s, handoff_wait_s) from (previous micro-step end or None, its group's arrival,
    its start): the replay starts it at max(arrival + wait, previous end + busy); each micro-step
    is attributed to the term that the current estimates make the larger, a few times over."""
    hb = hw = 0.0
    for _ in range(5):
        busy = [s - f for f, r, s in rows if f is not None and f + hb >= r + hw]
        wait = [s - r for f, r, s in rows if f is None or f + hb < r + hw]
        hb = statistics.fmean(busy) if busy else 0.0
        hw = statistics.fmean(wait) if wait else 0.0
    return float(hb), float(hw)


def load_run(run_dir: str) -> dict:
    return {"dir": run_dir, "config": read_config(run_dir), "events": read_timeline(run_dir),
            "metrics": read_metrics(run_dir)}


def calibrate(run_dirs: list[str], warmup: int = 2, engine_model: str = "auto") -> dict:
    """{"modes": {mode: calibrate_mode(its runs)}} over the given run directories."""
    by_mode: dict[str, list[dict]] = {}
    for d in run_dirs:
        run = load_run(d)
        by_mode.setdefault(run["config"]["trainer"]["mode"], []).append(run)
    return {"modes": {m: calibrate_mode(runs, warmup, engine_model) for m, runs in by_mode.items()}}


def predict_from_calibration(calib: dict, mode: str, costs_from: str | None = None, cluster: Cluster | None = None,
                             workload: Workload | None = None, steps: int = 20, seed: int = 0,
                             measured_lengths: bool = False) -> Prediction:
    """Replay `mode` with the costs calibrated on `costs_from` (default: `mode`'s own runs, else
    the other split mode's for a split mode) and the calibrated runs' workload unless given:
    lengths drawn from their empirical distribution, or (measured_lengths) the measured steps'
    own lengths, step by step, of `mode`'s runs."""
    modes = calib["modes"]
    src = costs_from or (mode if mode in modes else {"periodic": "sync_split", "sync_split": "periodic"}.get(mode))
    if src not in modes:
        raise ValueError(f"no calibration for mode {mode} (calibrated: {', '.join(modes)})")
    m = modes[src]
    wl = m["workload"]
    if workload is None:
        workload = Workload(wl["prompts"], wl["n"], EmpiricalLengths(wl["response_lengths"]),
                            EmpiricalLengths(wl["prompt_lengths"]), wl["micro_batch_size"])
    if cluster is None:
        cl = m["cluster"]
        if mode == "sync":
            cluster = Cluster(rollout_devices=0, trainer_devices=cl["world"], slots=wl["slots"],
                              colocated_devices=cl["world"], colocated_engines=1)
        else:
            cluster = Cluster(rollout_devices=cl["engines"], trainer_devices=max(1, cl["devices"] - cl["engines"]),
                              slots=wl["slots"])
    plans = None
    if measured_lengths:
        plans = modes[mode if mode in modes else src]["workload"]["steps"]
        steps = len(plans)
    return simulate(mode, workload, cluster, Costs.from_dict(m["costs"]), steps=steps, seed=seed, plans=plans)


# ---------------------------------------------------------------------- costs from hardware assumptions
@dataclass
class Hardware:
    """A device and the efficiencies assumed on it; each figure with where it comes from."""
    name: str
    peak_flops: float               # dense bf16 FLOP/s per device
    hbm_bytes_per_s: float
    mfu_train: float                # achieved / peak in the training micro-steps
    mfu_prefill: float
    mfu_decode: float               # compute part of a decode step
    mbu_decode: float               # achieved / peak HBM bandwidth when a decode step reads weights + KV
    decode_overhead_s: float        # per engine step (launch, sampling, scheduling)
    micro_step_overhead_s: float
    optimizer_bytes_per_param: float
    allreduce_bytes_per_s: float    # per device, data-parallel gradient all-reduce (ring)
    sync_bytes_per_s: float         # weight sync, trainer -> each rollout engine
    sync_overhead_s: float
    reward_item_s: float            # per response, all reward workers together
    dispatch_s: float
    colocated_sync_bytes_per_s: float = 100e9   # sync mode: the engine shares the trainer's device
    sources: dict = field(default_factory=dict)


def costs_from_hardware(shape: ModelShape, hw: Hardware, tp: int, dp: int, dtype_bytes: int = 2,
                        colocated: bool = False) -> Costs:
    """Stage costs of `shape` on `hw`: decode memory-bound (weights + KV read at mbu_decode of the
    HBM bandwidth) plus its compute at mfu_decode; prefill and training compute-bound at their
    MFU; training per DP rank of `tp` devices (policy fwd+bwd and reference fwd: 8 N per token,
    attention 8 L d per token pair), Adam memory-bound plus a ring all-reduce of fp32 gradients."""
    n = shape.matmul_params
    w_bytes = shape.total_params * dtype_bytes
    gen = GenCosts(
        decode_s=w_bytes / (hw.hbm_bytes_per_s * hw.mbu_decode) + hw.decode_overhead_s,
        decode_row_s=2 * n / (hw.peak_flops * hw.mfu_decode),
        decode_ctx_s=shape.kv_bytes_per_token(dtype_bytes) / (hw.hbm_bytes_per_s * hw.mbu_decode)
        + 4 * shape.layers * shape.attn_dim / (hw.peak_flops * hw.mfu_decode),
        prefill_s=hw.decode_overhead_s, prefill_token_s=2 * n / (hw.peak_flops * hw.mfu_prefill),
        engine="incremental", share_prompt=True)
    shard = shape.total_params / tp
    allreduce = 2 * (dp - 1) / dp * shard * 4 / hw.allreduce_bytes_per_s if dp > 1 else 0.0
    return Costs(
        gen=gen, micro_step_s=hw.micro_step_overhead_s,
        token_s=8 * n / (tp * hw.peak_flops * hw.mfu_train),
        attn_s=8 * shape.layers * shape.attn_dim / (tp * hw.peak_flops * hw.mfu_train),
        pad=True, optimizer_s=shard * hw.optimizer_bytes_per_param / hw.hbm_bytes_per_s + allreduce,
        reward_call_s=0.001, reward_item_s=hw.reward_item_s, sync_s=hw.sync_overhead_s,
        sync_byte_s=1.0 / (hw.colocated_sync_bytes_per_s if colocated else hw.sync_bytes_per_s),
        dispatch_s=hw.dispatch_s, result_s=0.001,
        handoff_busy_s=0.002, handoff_wait_s=0.002, post_train_s=0.0)
