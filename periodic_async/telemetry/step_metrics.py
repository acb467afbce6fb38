"""A step's rollout, reward and throughput metrics from its groups and timings.

Names follow verl where one exists (critic/score/mean, response_length/mean, timing_s/gen,
perf/throughput in tokens/s/device, training/off_policy/trajectory_staleness/mean); our own get
their own prefix (reward/, rollout/, rollouter/, trainer/, perf/overlap_*).
"""
from __future__ import annotations

import statistics


def union_length(intervals) -> float:
    """Total length covered by a set of [start, end] intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def rollout_metrics(groups, stats, step_s: float, num_engines: int, restarts: int) -> dict:
    """groups: the batch's scored groups; stats: its RolloutStats; num_engines: rollout engines
    that generated it (for the idle ratio)."""
    scores = [s for g in groups for s in g.rewards]
    adv = [a for g in groups for a in g.advantages]
    resp_len = [len(r.response_ids) for g in groups for r in g.results]
    truncated = sum(r.finish_reason == "length" for g in groups for r in g.results)
    busy: dict[int, list[tuple[float, float]]] = {}
    for r in stats.results:
        busy.setdefault(r.timings.get("worker", 0), []).append((r.timings["start"], r.timings["end"]))
    busy_s = sum(union_length(iv) for iv in busy.values()) / max(1, num_engines)
    out = {
        "rollout/generated": len(stats.results),     # every response of the step, trained on or not
        "reward/num_errors": stats.num_errors, "reward/num_timeouts": stats.num_timeouts,
        "reward/num_invalid": stats.num_invalid,
        "timing_s/gen": stats.gen_s, "timing_s/reward": stats.reward_s,
        "rollouter/idle_ratio": max(0.0, 1.0 - busy_s / step_s),
        "rollouter/restarts": restarts,
    }
    ends = sorted(r.timings["end"] for r in stats.results)
    if ends:
        # from the moment half the step's responses had finished to the last one: the stretch in
        # which the engines run at most half full, waiting on the tail (SAGC's straggler cost)
        out["rollouter/tail_s"] = ends[-1] - ends[(len(ends) - 1) // 2]
    if not groups:      # nothing trained this step (an allocator kept no group)
        return out
    return {
        **out,
        "critic/score/mean": statistics.fmean(scores), "critic/score/max": max(scores),
        "critic/score/min": min(scores), "critic/rewards/mean": statistics.fmean(scores),
        "critic/advantages/mean": statistics.fmean(adv), "critic/advantages/max": max(adv),
        "critic/advantages/min": min(adv),
        "response_length/mean": statistics.fmean(resp_len), "response_length/max": max(resp_len),
        "response_length/min": min(resp_len), "response_length/median": statistics.median(resp_len), "response_length/clip_ratio": truncated / len(resp_len),
        "prompt_length/mean": statistics.fmean(len(g.prompt_ids) for g in groups),
        "rollout/group_size/mean": statistics.fmean(g.size for g in groups),
        "rollout/solve_all_ratio": sum(max(g.rewards) >= 1.0 for g in groups) / len(groups),
        **_overlong_metrics(groups),
    }


def _overlong_metrics(groups) -> dict:
    """reward.overlong_buffer: the mean penalty added and the share of responses inside the buffer."""
    penalties = [p for g in groups for p in g.overlong_penalties]
    if not penalties:
        return {}
    return {"reward/overlong_penalty/mean": statistics.fmean(penalties),
            "reward/overlong_penalty/ratio": sum(p < 0 for p in penalties) / len(penalties)}


def overlap_metrics(gen_interval: tuple[float, float], train_intervals) -> dict:
    """How much generation and training ran at the same time: the length of the generation
    interval [dispatch, last group scored] covered by the trainer's epoch-1 compute intervals (the
    only training that can overlap: the optimizer steps wait for the whole batch), and that as a
    share of the shorter of the two."""
    g0, g1 = gen_interval
    train = [(a, b) for a, b in train_intervals if b > a]
    overlap = union_length([(max(a, g0), min(b, g1)) for a, b in train if min(b, g1) > max(a, g0)])
    shorter = min(g1 - g0, union_length(train))
    return {"perf/overlap_s": overlap, "perf/overlap_ratio": overlap / shorter if shorter > 0 else 0.0}


def throughput_metrics(groups, step_s: float, num_devices: int, trainer_version: int) -> dict:
    """Tokens (prompt + response per sample) per second per device of the whole job, and the
    samples' staleness: trainer_version - 1 (the version trained at) - the generating version, 0
    when strictly on-policy. Per sequence (`trajectory_staleness`) that is its first token's
    version, the oldest; per token (`rollout/token_staleness`) each token's own (a response that
    a weight update interrupted has several: `rollout/interrupted_ratio` of them)."""
    results = [r for g in groups for r in g.results]
    n_tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in results)
    staleness = [trainer_version - 1 - r.policy_version for r in results]
    token_staleness = [trainer_version - 1 - v for r in results for v in r.versions()]
    return {
        "perf/total_num_tokens": n_tokens,
        "perf/throughput": n_tokens / step_s / num_devices,
        "training/off_policy/trajectory_staleness/mean": float(statistics.fmean(staleness)) if staleness else 0.0,
        "training/off_policy/trajectory_staleness/max": float(max(staleness)) if staleness else 0.0,
        "rollout/token_staleness/mean": float(statistics.fmean(token_staleness)) if token_staleness else 0.0,
        "rollout/interrupted_ratio": (sum(r.token_versions is not None for r in results) / len(results)
                                      if results else 0.0),
    }
