"""Which samples each step trained: run_dir/samples.jsonl (trainer.record_samples), written on
rank 0 right after the step's training, one flushed line at a time, for tools/soak.py, which checks
from it that no sample is lost or trained twice across worker kills and a trainer kill + resume.

The file is appended to, never rewritten: a resumed run adds its lines after the killed run's, so
the file shows both. One JSON object per line, each with `kind` and `run` (a token of the process
that wrote it):
- start: one per run, first; `after_step` (the checkpoint step it resumed from, 0 when fresh),
  `pid`.
- group: one per trained group (its samples were in the step's gradient); `step`, `group` (its
  training position), `prompt` (its prompt token ids), `answer`, `samples` (the sample indices,
  ascending), `versions` (each sample's policy version, same order).
- step: after the step's groups: `step`, `groups`, `samples` (the counts), `worker_pids` (the
  local rollout workers' process ids, [] without workers), `restarts` (the pool's worker restarts
  so far in this run, 0 without workers).
A step without its `step` line was cut by a kill. What a run trained after the checkpoint a later
run resumed from was undone by the resume: `effective_steps` takes each step from the last run that
trained it.
"""
from __future__ import annotations

import json
import os
import time

FILE = "samples.jsonl"


class SampleTrace:
    def __init__(self, run_dir: str, after_step: int):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, FILE)
        self.run = f"{os.getpid()}-{time.time_ns()}"
        cut = False
        if os.path.exists(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"      # a line cut by a kill: ours starts on a new line
        self._file = open(self.path, "a")
        if cut:
            self._file.write("\n")
        self._write({"kind": "start", "after_step": after_step, "pid": os.getpid()})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps({"run": self.run, **record}) + "\n")

    def record(self, step: int, groups, worker_pids=(), restarts: int = 0) -> None:
        """groups: the step's trained groups (scheduling.group.Group, non-empty)."""
        samples = 0
        for g in groups:
            self._write({"kind": "group", "step": step, "group": g.group_index, "prompt": list(g.prompt_ids),
                         "answer": g.answer, "samples": [r.sample_index for r in g.results],
                         "versions": list(g.policy_versions)})
            samples += g.size
        self._write({"kind": "step", "step": step, "groups": len(groups), "samples": samples,
                     "worker_pids": list(worker_pids), "restarts": restarts})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_sample_trace(path: str) -> tuple[list[dict], int]:
    """The runs of a samples.jsonl, in order: {"run", "after_step", "pid", "groups": {step: [group
    records]}, "steps": {step: step record}}; and the number of unreadable lines (cut by a kill)."""
    runs: dict[str, dict] = {}
    bad = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                kind, run = rec["kind"], rec["run"]
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            if kind == "start":
                runs[run] = {"run": run, "after_step": rec["after_step"], "pid": rec.get("pid"),
                             "groups": {}, "steps": {}}
            elif run not in runs:
                bad += 1
            elif kind == "group":
                runs[run]["groups"].setdefault(rec["step"], []).append(rec)
            elif kind == "step":
                runs[run]["steps"][rec["step"]] = rec
    return list(runs.values()), bad


def effective_steps(runs: list[dict]) -> dict[int, tuple[dict, list[dict]]]:
    """step -> (step record, group records) of the run whose training of it stands: the last run
    that trained it, among those that started before it (a resumed run undoes the steps after its
    checkpoint). Steps without a `step` line (cut by a kill, then undone) are left out."""
    out: dict[int, tuple[dict, list[dict]]] = {}
    for run in runs:
        for step in [s for s in out if s > run["after_step"]]:
            del out[step]                         # undone by this run's resume
        for step, rec in run["steps"].items():
            out[step] = (rec, run["groups"].get(step, []))
    return dict(sorted(out.items()))
