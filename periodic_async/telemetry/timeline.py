"""Timeline of a run: generation (one lane per worker slot), reward scoring, training micro-steps,
the optimizer step and weight-sync intervals, in perf_counter seconds; written as timeline.jsonl
(trainer.record_timeline) for tools/ (bench_modes.py, profile_run.py, simulate.py).

One JSON object per line, every one with `step`, `kind`, `lane`, `start`, `end`:
- generate (lane workerW/slotS): one per sample, from its admission to a slot to the end of the
  engine step that finished it; `worker`, `slot`, `group`, `sample`, `prompt_tokens`,
  `response_tokens`, `finish` (stop | length).
- reward (lane trainer): one per Scorer.rewards call: the requests one poll of the rollout pool
  completed (a group or several); `groups`, `items`. It runs on the producer thread.
- train (lane trainer): one per epoch-1 micro-step of trainer rank 0; `index`, `sequences`,
  `tokens` (prompt + response), `response_tokens`, `padded_tokens` (rows x longest row: what the
  unshared packing computes), `groups` (the groups whose samples it holds).
- optimizer (lane trainer): from the end of the last micro-step to the end of the batch: the
  optimizer step (and the later PPO epochs when actor.ppo_epochs > 1).
- update_weights (lane trainer): the weight sync.
- step (lane trainer): the whole step as timing_s/step measures it; `mode`, `devices` (the
  perf/throughput divisor), `engines`, `world`, `dp_size`, `micro_batch_size`, `dispatch`,
  `gen_end` (the rollout side's timing_s/gen interval).
Lanes stay `trainer` or `workerW/slotS` (tools/bench_modes.py draws by lane).
"""
from __future__ import annotations

import json
import threading
import time

from ..scheduling.dp_assignment import TokenBudget, assign_groups, cut_by_tokens, cut_micro_batches


class Timeline:
    def __init__(self):
        self.events: list[dict] = []
        self._reward: list[dict] = []       # scoring intervals since the last record_step
        self._lock = threading.Lock()

    def watch_scorer(self, scorer) -> None:
        """Record the interval of every `scorer.rewards(groups, stats)` call (the producer thread's
        scoring, or the colocated producer's) for the step being run."""
        inner = scorer.rewards

        def score(groups, stats):
            t0 = time.perf_counter()
            try:
                return inner(groups, stats)
            finally:
                event = {"kind": "reward", "lane": "trainer", "start": t0, "end": time.perf_counter(),
                         "groups": [g.group_index for g in groups], "items": sum(g.size for g in groups)}
                with self._lock:
                    self._reward.append(event)

        scorer.rewards = score

    def record_step(self, step: int, results, train_intervals, sync_interval, step_interval=None, groups=None,
                    micro_batch_size: int | None = None, dp_size: int = 1, train_end: float | None = None,
                    info: dict | None = None) -> None:
        """results: the batch's RolloutResults; train_intervals: (start, end) of rank 0's epoch-1
        micro-steps; sync_interval: the weight sync's; step_interval: the step's (timing_s/step);
        groups: the batch's groups in completion order, to give each micro-step its samples
        (rank 0's share, packed `micro_batch_size` (an int, or a TokenBudget) at a time as
        train/step.py does); train_end: when the batch's training (optimizer step included) ended;
        info: the step event's fields."""
        for r in results:
            w = r.timings.get("worker", 0)
            self.events.append({"step": step, "kind": "generate", "lane": f"worker{w}/slot{r.timings['slot']}",
                                "start": r.timings["start"], "end": r.timings["end"], "worker": w,
                                "slot": r.timings["slot"], "group": r.group_index, "sample": r.sample_index,
                                "prompt_tokens": len(r.prompt_ids), "response_tokens": len(r.response_ids),
                                "finish": r.finish_reason})
        with self._lock:
            rewards, self._reward = self._reward, []
        for e in rewards:
            self.events.append({"step": step, **e})
        batches = _micro_batches(groups, micro_batch_size, dp_size) if groups is not None and micro_batch_size else None
        if batches is not None and len(batches) != len(train_intervals):
            batches = None       # not this rank's packing (another layout): intervals without their samples
        for i, (a, b) in enumerate(train_intervals):
            event = {"step": step, "kind": "train", "lane": "trainer", "start": a, "end": b, "index": i}
            if batches is not None:
                samples = batches[i]
                lens = [p + r for _, p, r in samples]
                event.update(sequences=len(samples), tokens=sum(lens), response_tokens=sum(r for _, _, r in samples),
                             padded_tokens=len(samples) * max(lens), groups=sorted({g for g, _, _ in samples}))
            self.events.append(event)
        if train_end is not None:
            start = train_intervals[-1][1] if train_intervals else train_end
            self.events.append({"step": step, "kind": "optimizer", "lane": "trainer", "start": start, "end": train_end})
        self.events.append({"step": step, "kind": "update_weights", "lane": "trainer",
                            "start": sync_interval[0], "end": sync_interval[1]})
        if step_interval is not None:
            self.events.append({"step": step, "kind": "step", "lane": "trainer", "start": step_interval[0],
                                "end": step_interval[1], **(info or {})})

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")


def _micro_batches(groups, micro_batch_size: "int | TokenBudget", dp_size: int) -> list[list[tuple[int, int, int]]]:
    """DP rank 0's micro-batches as (group, prompt tokens, response tokens) per sample: its groups
    in completion order, split by the trainer's rule (scheduling/dp_assignment.py): every
    `micro_batch_size` samples, or by its TokenBudget."""
    owner = assign_groups({g.group_index: g.size for g in groups}, dp_size)
    mine = ([(g.group_index, len(r.prompt_ids), len(r.response_ids)) for r in g.results]
            for g in groups if owner[g.group_index] == 0)
    if isinstance(micro_batch_size, TokenBudget):
        return list(cut_by_tokens(micro_batch_size.atoms(mine, lambda x: (x[1], x[2])), micro_batch_size.tokens))
    return list(cut_micro_batches(mine, micro_batch_size))
