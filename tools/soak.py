"""Fault soak of the producer core (issue 25, item 6): the default job in every mode, as a
subprocess, with rollout workers SIGKILLed every few steps and the trainer itself SIGKILLed once
per mode and resumed from its newest checkpoint; then a check, from the trainer's own record of
what it trained (trainer.record_samples: run_dir/samples.jsonl, periodic_async/telemetry/
sample_trace.py), that the run reached its last step, that no sample was lost or trained twice,
that every step trained the prompts the data order gives, and that no process outlived its trainer.

    nice -n 10 python tools/soak.py --work-dir runs/soak --json runs/soak/summary.json

Modes: sync_split, periodic, async (trainer.max_staleness=2) with `--workers` rollout workers,
worker kills and one trainer kill; sync (engine in the trainer, no workers): the trainer kill only.
Not for CI (tens of minutes); docs/reliability.md has the command and the figures.

For every mode:
- The trainer runs as `python -m periodic_async trainer.mode=M ... trainer.record_samples=true
  trainer.save_every=S` in its own run directory (removed first); its output goes to
  run_dir/trainer-<run>.log.
- After every `kill_every` steps (drawn anew each time, from a seeded generator) one rollout worker
  is SIGKILLed: a pid of the trace's latest step line that is alive and a child of the trainer.
  A kill is "survived" once a later step line of the same trainer lists a replacement in its place.
- Once, at a drawn step in the middle third of the run (plus a drawn delay under a second, so the
  kill lands anywhere in a step, a checkpoint save included), the trainer is SIGKILLed. Every
  descendant it had must be gone within 15 s (orphans otherwise; they are then killed by pid and
  reported); the newest complete checkpoint (a step_* directory with meta.json) is noted and the
  same command is started again (trainer.resume=auto).
- At the end: exit code 0, the last step reached, no descendant left, and the check of the trace
  (`check_trace`): every run trains consecutive steps from the step after its checkpoint (the
  resumed one from the checkpoint that was newest at the kill); taking each step from the last
  run that trained it (steps after the resume point from the resumed run), every step 1..total
  is there once, with every (group position, sample index) of its plan exactly once (lost:
  missing ones; duplicated: repeats), each group's prompt ids and answer equal to what the data
  loader's order gives for that step and position (the prompt sequence is fixed by
  (data.seed, epoch) in every mode, async included, so this also says each prompt of an epoch was
  trained once in that epoch), and every sample's policy version within the mode's staleness
  bound (step - 1 - eta .. step - 1).
Progress: one line per event (mode start, every `--progress-every` steps, worker kill, restart
seen, trainer kill, orphan check, resume, mode end) on stdout.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["sync_split", "periodic", "async", "sync"]
ASYNC_ETA = 2

try:
    import psutil
except ImportError:          # /proc fallback below
    psutil = None


# ---------------------------------------------------------------------- processes


def _children(pid: int) -> dict[int, int]:
    """pid -> ppid of every live (non-zombie) descendant of `pid`."""
    if psutil is not None:
        try:
            out = {}
            for c in psutil.Process(pid).children(recursive=True):
                try:
                    if c.status() != psutil.STATUS_ZOMBIE:
                        out[c.pid] = c.ppid()
                except psutil.NoSuchProcess:
                    pass
            return out
        except psutil.NoSuchProcess:
            return {}
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p and c not in out:
                out[c] = pp
                frontier.append(c)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def _wait_gone(pids, timeout: float) -> list[int]:
    """The pids still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    return left


# ---------------------------------------------------------------------- what the data order gives


def expected_prompts(run_dir: str, total_steps: int) -> dict[int, list[tuple[list[int], str]]]:
    """step -> [(prompt ids, answer)] by training position, as the run's config (run_dir/
    config.yaml) and the data loader's order give them: PromptLoader batches, rendered by the
    run's prompt renderer with the run's tokenizer (a plain BatchPlan: position i = the batch's
    i-th record)."""
    sys.path.insert(0, ROOT)
    from periodic_async.config import load_config
    from periodic_async.data import prompts
    from periodic_async.data.dataset import PromptLoader, load_records
    from periodic_async.models.tokenizer import load_tokenizer
    from periodic_async.train.validation import split_validation
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    records, _ = split_validation(load_records(cfg.data), cfg.data)
    tokenizer = load_tokenizer(cfg.model.path or os.path.join(run_dir, "model_init"))
    renderer = prompts.build(cfg.data, tokenizer)
    loader = PromptLoader(records, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
    out = {}
    for step in range(1, total_steps + 1):
        batch = []
        for rec in loader.next_batch():
            ids = renderer.render(rec)
            if ids is None:
                raise RuntimeError("a prompt is left out (data.overlong_prompt: skip): the soak's order check "
                                   "does not model replacements")
            batch.append((list(ids), rec.answer))
        out[step] = batch
    return out


# ---------------------------------------------------------------------- the check


def check_trace(runs: list[dict], expected: dict[int, list[tuple[list[int], str]]], total_steps: int,
                group_size: int, eta: int, resume_points: list[int]) -> dict:
    """Check a sample trace (telemetry.sample_trace.read_sample_trace's runs). expected: step ->
    [(prompt ids, answer)] per training position; resume_points: the checkpoint step each run after
    the first must have resumed from. Returns the figures and `problems` (empty: all good)."""
    from periodic_async.telemetry.sample_trace import effective_steps
    problems: list[str] = []
    if len(runs) != 1 + len(resume_points):
        problems.append(f"{len(runs)} runs in the trace, expected {1 + len(resume_points)}")
    for i, run in enumerate(runs):
        want_after = 0 if i == 0 else (resume_points[i - 1] if i - 1 < len(resume_points) else None)
        if want_after is not None and run["after_step"] != want_after:
            problems.append(f"run {i} resumed after step {run['after_step']}, the newest checkpoint was {want_after}")
        steps = sorted(run["steps"])
        first = run["after_step"] + 1
        if steps != list(range(first, first + len(steps))):
            problems.append(f"run {i} trained steps {_ranges(steps)}, not consecutive from {first}")
        cut = sorted(set(run["groups"]) - set(steps))
        if cut and (i == len(runs) - 1 or cut != [first + len(steps)]):
            problems.append(f"run {i}: groups without their step line at steps {cut}")
    eff = effective_steps(runs)
    if list(eff) != list(range(1, total_steps + 1)):
        missing = sorted(set(range(1, total_steps + 1)) - set(eff))
        extra = sorted(set(eff) - set(range(1, total_steps + 1)))
        problems.append(f"trained steps: missing {_ranges(missing)}, beyond the last {_ranges(extra)}")
    lost = duplicated = wrong_prompt = stale = checked = 0
    for step, (rec, groups) in eff.items():
        want = expected.get(step, [])
        seen = collections.Counter((g["group"], s) for g in groups for s in g["samples"])
        plan = {(gi, s) for gi in range(len(want)) for s in range(group_size)}
        step_lost = len(plan - set(seen))
        step_dup = sum(c - 1 for c in seen.values()) + sum(c for k, c in seen.items() if k not in plan)
        lost += step_lost
        duplicated += step_dup
        checked += sum(seen.values())
        if step_lost or step_dup:
            problems.append(f"step {step}: {step_lost} sample(s) lost, {step_dup} duplicated or not in the plan")
        by_pos = {}
        for g in groups:
            by_pos.setdefault(g["group"], g)
        for gi, (ids, answer) in enumerate(want):
            g = by_pos.get(gi)
            if g is not None and (g["prompt"] != ids or g["answer"] != answer):
                wrong_prompt += 1
                if wrong_prompt <= 5:
                    problems.append(f"step {step} position {gi}: trained prompt {g['prompt']} / {g['answer']!r}, "
                                    f"the data order gives {ids} / {answer!r}")
        bad_v = [v for g in groups for v in g["versions"] if not step - 1 - eta <= v <= step - 1]
        stale += len(bad_v)
        if bad_v:
            problems.append(f"step {step}: {len(bad_v)} sample(s) of policy versions {sorted(set(bad_v))} "
                            f"outside {step - 1 - eta}..{step - 1}")
        if rec["samples"] != len([s for g in groups for s in g["samples"]]) or rec["groups"] != len(groups):
            problems.append(f"step {step}: the step line counts {rec['groups']} groups / {rec['samples']} samples, "
                            f"the group lines {len(groups)} / {sum(len(g['samples']) for g in groups)}")
    if wrong_prompt > 5:
        problems.append(f"... {wrong_prompt} wrong prompts in all")
    return {"steps": len(eff), "samples_checked": checked, "lost": lost, "duplicated": duplicated,
            "wrong_prompts": wrong_prompt, "stale": stale, "problems": problems}


def _ranges(xs) -> str:
    xs = sorted(xs)
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


# ---------------------------------------------------------------------- one mode


class Soak:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.rng = random.Random(args.seed)
        self.proc: subprocess.Popen | None = None

    def say(self, mode: str, step, text: str) -> None:
        s = f"step {step:5d}" if isinstance(step, int) else f"{'':10s}"
        print(f"[{time.monotonic() - self.t0:7.1f}s] {mode:10s} {s}  {text}", flush=True)

    def command(self, mode: str, run_dir: str, steps: int) -> list[str]:
        a = self.args
        cmd = [a.python, "-m", "periodic_async", f"trainer.mode={mode}", f"trainer.total_steps={steps}",
               f"trainer.run_dir={run_dir}", "trainer.record_samples=true", f"trainer.save_every={a.save_every}",
               "trainer.keep_checkpoints=2", "trainer.progress_bar=false", "trainer.save_final=false",
               "trainer.tensorboard=false"]
        if mode == "async":
            cmd.append(f"trainer.max_staleness={ASYNC_ETA}")
        if mode != "sync":
            cmd.append(f"rollout.num_workers={a.workers}")
        return cmd + list(a.override)

    def start(self, cmd, run_dir: str, n: int) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
        log = open(os.path.join(run_dir, f"trainer-{n}.log"), "w")
        try:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def run_mode(self, mode: str) -> dict:
        a = self.args
        steps = a.sync_steps if mode == "sync" else a.steps
        workers = 0 if mode == "sync" else a.workers
        run_dir = os.path.abspath(os.path.join(a.work_dir, mode))
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        trace = os.path.join(run_dir, "samples.jsonl")
        cmd = self.command(mode, run_dir, steps)
        lo, hi = a.kill_every
        trainer_kill_at = self.rng.randint(steps // 3, 2 * steps // 3)
        next_kill = self.rng.randint(lo, hi) if workers else None
        res = {"mode": mode, "steps": steps, "workers": workers, "worker_kills": 0, "kills_survived": 0,
               "kills_unconfirmed": 0, "restarts_seen": 0, "trainer_kills": 0, "resumes": [], "orphans": [],
               "descendants_checked": 0, "exit_codes": [], "problems": []}
        t_mode = time.monotonic()
        self.say(mode, None, f"start: {steps} steps, {workers} worker(s), checkpoint every {a.save_every}, "
                             f"trainer SIGKILL after step {trainer_kill_at}")
        runs = 0
        self.proc = self.start(cmd, run_dir, runs)
        offset, tail = 0, b""
        last_step, run_token, pids, restarts = 0, None, [], 0
        pending_kills: list[dict] = []      # worker kills of this trainer not yet seen replaced
        seen_desc: dict[int, str] = {}
        last_progress = time.monotonic()
        while True:
            # descendants of the trainer, for the orphan check (every poll: workers come and go)
            for pid in _children(self.proc.pid):
                if pid not in seen_desc:
                    seen_desc[pid] = _cmdline(pid)
            # new complete lines of the trace
            if os.path.exists(trace):
                with open(trace, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                offset += len(data)
                lines = (tail + data).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("kind") == "start":
                        run_token = rec["run"]
                        restarts = 0
                        self.say(mode, rec["after_step"], f"run {runs} started (pid {rec['pid']}, after step "
                                                          f"{rec['after_step']})")
                    elif rec.get("kind") == "step" and rec["run"] == run_token:
                        last_step, last_progress = rec["step"], time.monotonic()
                        if rec["restarts"] > restarts:
                            self.say(mode, last_step, f"restart seen: {rec['restarts'] - restarts} more, "
                                                      f"{rec['restarts']} in this run; workers {rec['worker_pids']}")
                        restarts, pids = rec["restarts"], rec["worker_pids"]
                        for k in list(pending_kills):
                            if k["pid"] not in pids and len(pids) == workers:
                                pending_kills.remove(k)
                                res["kills_survived"] += 1
                        if last_step % a.progress_every == 0:
                            self.say(mode, last_step, f"progress ({time.monotonic() - t_mode:.0f}s in this mode)")
            rc = self.proc.poll()
            if rc is not None:
                res["exit_codes"].append(rc)
                res["restarts_seen"] += restarts
                res["kills_unconfirmed"] += len(pending_kills)
                left = _wait_gone(list(seen_desc), 15.0)
                res["descendants_checked"] += len(seen_desc)
                self._orphans(mode, last_step, left, seen_desc, res)
                self.say(mode, last_step, f"trainer exited {rc}; {len(seen_desc)} descendant(s) seen, "
                                          f"{len(left)} left")
                if rc != 0:
                    res["problems"].append(f"trainer run {runs} exited {rc} (see {run_dir}/trainer-{runs}.log)")
                break
            if time.monotonic() - last_progress > a.stall_s:
                res["problems"].append(f"no step for {a.stall_s:.0f}s after step {last_step}: stopped (hang)")
                self.say(mode, last_step, f"HANG: no step for {a.stall_s:.0f}s; stopping the trainer")
                self.stop()
                continue
            if workers and next_kill is not None and next_kill <= last_step < steps:
                mine = _children(self.proc.pid)
                alive = [p for p in pids if p in mine and mine[p] == self.proc.pid and _alive(p)]
                if alive:
                    victim = self.rng.choice(alive)
                    os.kill(victim, signal.SIGKILL)
                    res["worker_kills"] += 1
                    pending_kills.append({"pid": victim, "step": last_step})
                    self.say(mode, last_step, f"SIGKILL rollout worker pid {victim} (kill {res['worker_kills']})")
                    next_kill = last_step + self.rng.randint(lo, hi)
            if not res["trainer_kills"] and last_step >= trainer_kill_at:
                time.sleep(self.rng.uniform(0.0, 1.0))
                for pid in _children(self.proc.pid):
                    seen_desc.setdefault(pid, _cmdline(pid))
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self.say(mode, last_step, f"SIGKILLed trainer pid {self.proc.pid} "
                                          f"({len(seen_desc)} descendant(s) seen in this run)")
                res["trainer_kills"] += 1
                from periodic_async.telemetry.sample_trace import read_sample_trace
                done_runs, _ = read_sample_trace(trace)     # the trace lags the trainer by a poll
                last_step = max(done_runs[-1]["steps"], default=last_step) if done_runs else last_step
                res["exit_codes"].append(self.proc.returncode)
                res["restarts_seen"] += restarts
                res["kills_unconfirmed"] += len(pending_kills)
                pending_kills = []
                t_kill = time.monotonic()
                left = _wait_gone(list(seen_desc), 15.0)
                linger = time.monotonic() - t_kill
                res["descendants_checked"] += len(seen_desc)
                res.setdefault("linger_s", []).append(round(linger, 1))
                self._orphans(mode, last_step, left, seen_desc, res)
                self.say(mode, last_step, f"killed after step {last_step}; orphan check: {len(seen_desc)} descendant(s) of the killed trainer, "
                                          f"{len(left)} alive after 15 s (the last one went after {linger:.1f} s)")
                from periodic_async.train.checkpoint import complete_checkpoints
                done = complete_checkpoints(run_dir)
                ckpt = int(os.path.basename(done[-1]).split("_")[1]) if done else 0
                res["resumes"].append({"killed_after_step": last_step, "checkpoint": ckpt})
                self.say(mode, last_step, f"resume: restarting from checkpoint step {ckpt}")
                runs += 1
                seen_desc = {}
                run_token, pids, restarts, last_step = None, [], 0, ckpt
                self.proc = self.start(cmd, run_dir, runs)
                last_progress = time.monotonic()
                if workers:
                    next_kill = ckpt + self.rng.randint(lo, hi)
            time.sleep(0.1)
        self.proc = None
        # the check
        from periodic_async.telemetry.sample_trace import read_sample_trace
        trace_runs, bad = read_sample_trace(trace)
        expected = expected_prompts(run_dir, steps)
        import yaml
        with open(os.path.join(run_dir, "config.yaml")) as f:
            group_size = yaml.safe_load(f)["rollout"]["n"]
        eta = ASYNC_ETA if mode == "async" else 0
        check = check_trace(trace_runs, expected, steps, group_size, eta,
                            [r["checkpoint"] for r in res["resumes"]])
        res.update({k: check[k] for k in ("steps", "samples_checked", "lost", "duplicated", "wrong_prompts", "stale")})
        res["reached_last_step"] = check["steps"] == steps and not any("missing" in p for p in check["problems"])
        res["cut_lines"] = bad
        res["problems"] += check["problems"]
        res["wall_s"] = round(time.monotonic() - t_mode, 1)
        self.say(mode, last_step, f"end: {res['worker_kills']} worker kills ({res['kills_survived']} survived, "
                                  f"{res['kills_unconfirmed']} unconfirmed), {res['restarts_seen']} restarts, "
                                  f"{res['trainer_kills']} trainer kill(s) resumed from {[r['checkpoint'] for r in res['resumes']]}, "
                                  f"{res['samples_checked']} samples checked: lost {res['lost']}, duplicated "
                                  f"{res['duplicated']}, wrong prompts {res['wrong_prompts']}, stale {res['stale']}, "
                                  f"orphans {len(res['orphans'])}, {res['wall_s']}s; "
                                  f"{'OK' if not res['problems'] else 'PROBLEMS: ' + '; '.join(res['problems'])}")
        return res

    def _orphans(self, mode, step, left, seen_desc, res) -> None:
        for pid in left:
            res["orphans"].append({"pid": pid, "cmdline": seen_desc.get(pid, "?")})
            self.say(mode, step, f"ORPHAN pid {pid}: {seen_desc.get(pid)}; killing it")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if left:
            res["problems"].append(f"{len(left)} process(es) outlived their trainer")

    def stop(self) -> None:
        """Stop the current trainer: SIGTERM (it stops its workers), SIGKILL after 30 s."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--steps", type=int, default=600, help="total steps of a mode with workers")
    ap.add_argument("--sync-steps", type=int, default=300, help="total steps of sync (trainer kill only)")
    ap.add_argument("--workers", type=int, default=2, help="rollout.num_workers")
    ap.add_argument("--kill-every", type=int, nargs=2, default=(3, 8), metavar=("MIN", "MAX"),
                    help="steps between worker kills, drawn uniformly")
    ap.add_argument("--save-every", type=int, default=10, help="trainer.save_every")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="runs/soak")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the trainer")
    ap.add_argument("--progress-every", type=int, default=50)
    ap.add_argument("--stall-s", type=float, default=300.0, help="no step for this long: a hang, stop")
    ap.add_argument("override", nargs="*", help="extra key=value overrides for every trainer")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    soak = Soak(args)
    results = []
    t0 = time.monotonic()
    try:
        for mode in args.modes.split(","):
            if mode not in MODES:
                ap.error(f"mode {mode!r}: allowed {', '.join(MODES)}")
            results.append(soak.run_mode(mode))
    finally:
        soak.stop()
    total = round(time.monotonic() - t0, 1)
    print()
    print("| mode | steps | worker kills (survived) | restarts seen | trainer kills / resumed from | "
          "samples checked | lost | duplicated | wrong prompts | stale | orphans | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['steps']} | {r['worker_kills']} ({r['kills_survived']}) | {r['restarts_seen']} | "
              f"{r['trainer_kills']} / step {', '.join(str(x['checkpoint']) for x in r['resumes'])} "
              f"(killed after {', '.join(str(x['killed_after_step']) for x in r['resumes'])}) | "
              f"{r['samples_checked']} | {r['lost']} | {r['duplicated']} | {r['wrong_prompts']} | {r['stale']} | "
              f"{len(r['orphans'])} | {r['wall_s']:.0f} s |")
    print(f"total wall time {total:.0f} s")
    failed = [r for r in results if r["problems"]]
    for r in failed:
        print(f"{r['mode']}: " + "; ".join(r["problems"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "total_wall_s": total, "modes": results}, f,
                      indent=1)
    print("soak: " + ("OK" if not failed else f"FAILED in {', '.join(r['mode'] for r in failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
