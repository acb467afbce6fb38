"""Calibration: stage costs (costs.Costs) fitted on measured runs' timelines (trainer.record_timeline
=true), and predictions from them (tools/simulate.py calibrate / check / predict).

The engine costs come from the sample stamps: the replay (engine.py, with the measured lengths)
says which engine step each admission and each finish belongs to, and non-negative least squares
(nnls.py) fits the costs to the time between consecutive stamps. Micro-steps, reward calls,
optimizer steps, weight syncs and the latencies between stages come from their own events.
"""
from __future__ import annotations

import statistics

from .costs import GEN_FEATURES, Cluster, Costs, GenCosts, Workload
from .engine import Sample, replay_engine
from .lengths import EmpiricalLengths
from .nnls import nnls
from .replay import Prediction, simulate
from .runs import load_run, steps_of


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
