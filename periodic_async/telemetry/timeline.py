"""Timeline of a run: generation (one lane per worker slot), training and weight-sync intervals,
in perf_counter seconds; written as timeline.jsonl (trainer.record_timeline) for tools/."""
from __future__ import annotations

import json


class Timeline:
    def __init__(self):
        self.events: list[dict] = []

    def record_step(self, step: int, results, train_intervals, sync_interval) -> None:
        for r in results:
            self.events.append({"step": step, "kind": "generate", "lane": f"worker{r.timings.get('worker', 0)}"
                                f"/slot{r.timings['slot']}", "start": r.timings["start"], "end": r.timings["end"]})
        for a, b in train_intervals:
            self.events.append({"step": step, "kind": "train", "lane": "trainer", "start": a, "end": b})
        self.events.append({"step": step, "kind": "update_weights", "lane": "trainer",
                            "start": sync_interval[0], "end": sync_interval[1]})

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")
