"""Throughput against TRL: TRL's GRPOTrainer and this project on the same GRPO work, side by side.

    python tools/bench_vs_trl.py [--setups small,medium] [--steps 8] [--warmup 2] [--repeats 2]
                                 [--modes periodic,sync_shared,periodic_shared] [--table FILE]

The work (the same for both sides): a random-init Qwen2 checkpoint with the project's char
tokenizer (one HF directory, loaded by both), the same random-digit prompts of exactly the
prompt length, 8 prompts x K=8 = 64 completions per optimizer step, exactly 64 sampled tokens per
completion, fp32, AdamW lr 3e-3, grad clip 1, no KL (TRL beta=0; project actor.kl_coef=0), the
same cheap reward (the share of '7's in the response), temperature 1, 2 CPU threads in all.

- TRL 1.16.0 GRPOTrainer, HF generate with min_new_tokens = max_new_tokens = 64 (EOS is masked out
  of sampling), micro-batches of --micro-batch completions (gradient accumulation to 64). It runs in
  its own venv, .venv-trl (made here on first use, pinned by tools/trl-constraints.txt).
- the project (`python -m periodic_async`), configs/default.yaml plus the overrides below, with
  rollout.ignore_eos=true (EOS may be sampled but does not end a response) and
  actor.micro_batch_size = --micro-batch. Modes: periodic (the default: 1 rollout worker process and
  the trainer sharing both cores, rollout.cpu_cores=shared), sync_shared (trainer.mode=sync +
  actor.shared_prompt), periodic_shared (periodic + actor.shared_prompt), sync (plain colocated),
  periodic_split / periodic_split_shared (rollout.cpu_cores=split: the worker on one core, the
  trainer on the other).

Setups: small and medium have fixed lengths; long_tail has small's shapes and long-tailed lengths
(LONG_TAIL_ALPHA): each prompt's K completions are its budget n long, on the project's side through
data.max_new_tokens_key (+ ignore_eos), on TRL's through a logits processor that masks EOS before n
and forces it at n (tools/trl_grpo_run.py --budgets); prompts in file order on both sides
(data.shuffle=false, TRL shuffle_dataset=False), so step s has the same lengths everywhere. HF
generate in TRL decodes all 64 rows until the step's longest is done (finished rows ride along);
the project's engine drops finished rows.

The FLOP/s account (issue 30; off with --no-account): tools/peak_flops.py measures the matmul rate at
the setup's own shapes (training rows: micro-batch x (P + 64) tokens; decode rows: 64) and the
fastest shape (peak) in this process before the runs; every side's useful FLOPs per step (generation
over P + 63 tokens, the policy's forward and backward over P + 64, per completion: the same work on
both sides, no reference model since neither has a KL term) over its median step, as GFLOP/s and a
share of peak; for the project's runs (trainer.record_timeline=true) tools/profile_run.py's stage
times give generation's and the micro-steps' own GFLOP/s over their busy time, against the model rate
at their rows, and the optimizer's seconds; `floor s` is the step if generation and training ran
at the model rate one after another, with nothing else.

Every side's run also logs tools/machine_load.py's account (the hypervisor's steal share over the
run, the run's CPU and system seconds); the table shows each side's largest steal over its
repeats: a slow repeat with steal was the VM's (or, as with colocated sync's second OpenMP team
before the fix, the side's own idling and waking threads: docs/performance.md).

Tokens are (prompt + completion) per completion: 64 x (P + 64) per step. Each side's tokens/s is
over the steps after the warm-up (steps W+1..N) of every repeat, from per-step wall times (TRL: a
TrainerCallback, time between step ends; project: metrics.jsonl timing_s/step). Within a repeat
the sides run one after another, in the same order, so slow phases of a shared machine hit all.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VENV = os.path.join(ROOT, ".venv-trl")
TRL_CONSTRAINTS = os.path.join(ROOT, "tools", "trl-constraints.txt")
TRL_PINS = ["torch==2.13.0", "transformers==5.19.0", "trl==1.16.0"]

# name: (hidden, layers, heads, kv heads, ffn, prompt tokens, new tokens)
SETUPS = {"small": (256, 4, 4, 2, 1024, 64, 64), "medium": (512, 8, 8, 4, 2048, 128, 64)}
SETUPS["long_tail"] = SETUPS["small"]      # small's shapes; its lengths come from LONG_TAIL_ALPHA
# Setups with long-tailed lengths: each prompt's completions are n tokens, n on 1..new drawn with
# P(n) ~ n ** -alpha (the long_tail task's law, data/synthetic.py; alpha 1: p50 ~8, mean ~13.5, and
# about 1 prompt in 7 at 32 or more), the same n for all K of a prompt; prompts in file order on
# both sides, so every step has the same lengths.
LONG_TAIL_ALPHA = {"long_tail": 1.0}
PROMPTS_PER_STEP, K = 8, 8
MODES = {"periodic": ["trainer.mode=periodic", "rollout.num_workers=1"],
         "sync_shared": ["trainer.mode=sync", "actor.shared_prompt=true"],
         "periodic_shared": ["trainer.mode=periodic", "rollout.num_workers=1", "actor.shared_prompt=true"],
         "sync": ["trainer.mode=sync"],
         "periodic_split": ["trainer.mode=periodic", "rollout.num_workers=1", "rollout.cpu_cores=split"],
         "periodic_split_shared": ["trainer.mode=periodic", "rollout.num_workers=1", "rollout.cpu_cores=split",
                                   "actor.shared_prompt=true"],
         # bounded staleness (eta 1: batch t + 1 generates while batch t trains); not on-policy
         "async1": ["trainer.mode=async", "trainer.max_staleness=1", "rollout.num_workers=1"],
         "async1_shared": ["trainer.mode=async", "trainer.max_staleness=1", "rollout.num_workers=1",
                           "actor.shared_prompt=true"]}
REWARD = '''def compute_score(response, answer):
    """The share of '7's in the response: cheap, and it differs within a group."""
    return response.count("7") / max(1, len(response))
'''


def log(msg: str) -> None:
    print(f"[bench_vs_trl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_trl_venv() -> str:
    """.venv-trl with torch 2.13.0 (CPU wheel) first, then trl 1.16.0, all pinned; redone when the
    constraints change."""
    py = os.path.join(TRL_VENV, "bin", "python")
    stamp = os.path.join(TRL_VENV, ".bench_vs_trl")
    with open(TRL_CONSTRAINTS, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()[:16]
    if os.path.exists(py) and os.path.exists(stamp) and open(stamp).read().strip() == want:
        return py
    if not os.path.exists(py):
        log(f"creating {TRL_VENV}")
        subprocess.run(["python3", "-m", "venv", TRL_VENV], check=True)
    pip = [py, "-m", "pip", "install", "-c", TRL_CONSTRAINTS]
    log("installing torch==2.13.0 (CPU wheel) into .venv-trl")
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    log("installing trl==1.16.0 + transformers==5.19.0 into .venv-trl (about a minute)")
    subprocess.run(pip + TRL_PINS, check=True)
    out = subprocess.run([py, "-c", "import torch, trl, transformers; print(torch.__version__, trl.__version__, "
                          "transformers.__version__)"], check=True, capture_output=True, text=True).stdout.split()
    if not out[0].endswith("+cpu"):
        sys.exit(f".venv-trl got torch {out[0]}, not the CPU wheel: check {TRL_CONSTRAINTS}")
    log(f".venv-trl: torch {out[0]}, trl {out[1]}, transformers {out[2]}")
    with open(stamp, "w") as f:
        f.write(want + "\n")
    return py


def make_work(d: str, setup: str, steps: int, seed: int) -> tuple[str, str, str, list | None]:
    """The model directory (HF Qwen2 + char tokenizer), the prompts jsonl, the reward file, and
    each prompt's length budget in file order (long-tailed setups; None: all `new` tokens)."""
    sys.path.insert(0, ROOT)
    from periodic_async.models.tiny import make_random_model_dir
    from periodic_async.models.tokenizer import build_char_tokenizer, mark_char_tokenizer
    hidden, layers, heads, kv, ffn, plen, new = SETUPS[setup]
    tok = build_char_tokenizer()
    model_dir = os.path.join(d, "model")
    make_random_model_dir(model_dir, hidden, layers, heads, kv, ffn, len(tok), seed=seed,
                          max_positions=max(1024, plen + new), eos_token_id=tok.eos_token_id)
    tok.save_pretrained(model_dir)
    mark_char_tokenizer(model_dir)
    rng = random.Random(seed)
    budgets = None
    if setup in LONG_TAIL_ALPHA:
        from periodic_async.data.synthetic import long_tail_length_pmf
        lengths, probs = long_tail_length_pmf(new, LONG_TAIL_ALPHA[setup])
        budgets = [int(x) for x in rng.choices(list(lengths), weights=list(probs), k=PROMPTS_PER_STEP * (steps + 2))]
    prompts = os.path.join(d, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(PROMPTS_PER_STEP * (steps + 2)):
            s = "".join(rng.choice("0123456789") for _ in range(plen - 1)) + "="
            assert len(tok(s, add_special_tokens=False).input_ids) == plen
            f.write(json.dumps({"question": s, "answer": "", **({"n": budgets[i]} if budgets else {})}) + "\n")
    reward = os.path.join(d, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    return model_dir, prompts, reward, budgets


def step_lengths(budgets: list | None, step: int, new: int) -> list[int]:
    """The completion lengths of optimizer step `step` (1-based): K per prompt, prompts in file order."""
    if budgets is None:
        return [new] * (PROMPTS_PER_STEP * K)
    return [n for n in budgets[(step - 1) * PROMPTS_PER_STEP: step * PROMPTS_PER_STEP] for _ in range(K)]


def run_trl(py: str, work, setup: str, steps: int, micro_batch: int, threads: int, run_dir: str,
            grad_ckpt: bool, held_heap: bool = False) -> list[float]:
    model_dir, prompts, reward, budgets = work
    _, _, _, _, _, plen, new = SETUPS[setup]
    out = os.path.join(run_dir, "trl_times.json")
    cmd = [py, os.path.join(ROOT, "tools", "trl_grpo_run.py"), "--model-dir", model_dir, "--prompts", prompts,
           "--reward", reward, "--steps", str(steps), "--out", out, "--micro-batch", str(micro_batch),
           "--prompt-len", str(plen), "--new-tokens", str(new), "--threads", str(threads),
           "--run-dir", os.path.join(run_dir, "trl")] + (["--gradient-checkpointing"] if grad_ckpt else []) + \
        (["--budgets"] if budgets else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    if held_heap:       # glibc keeps freed memory, as the project's cpu backend does (hold_host_heap)
        from periodic_async.backend_setup import host_malloc_env
        env.update(host_malloc_env("held"))
    _run(cmd, env, "trl" + (" held heap" if held_heap else ""))
    with open(out) as f:
        res = json.load(f)
    lens = res["mean_completion_length"]
    want = [statistics.fmean(step_lengths(budgets, i + 1, new)) for i in range(len(lens))]
    if any(abs(x - w) > 1e-6 for x, w in zip(lens, want)):
        sys.exit(f"TRL completions were not the budgeted lengths: mean lengths {lens}, expected {want}")
    return res["step_s"]


def useful_flops_per_step(shape, plen: int, lengths: list[list[int]]) -> dict:
    """Per step (the mean over `lengths`, each step's completion lengths): generation and the
    policy's forward + backward, the same on both sides."""
    from sim.flops import forward_flops, generation_flops
    gen = statistics.fmean(sum(generation_flops(shape, plen, n) for n in step) for step in lengths)
    train = statistics.fmean(sum(3 * forward_flops(shape, plen + n) for n in step) for step in lengths)
    return {"generate": gen, "train": train}


def stage_account(run_dir: str, warmup: int) -> dict:
    """A project run's generation and micro-step FLOP/s over their busy time, and optimizer s/step."""
    from profile_run import profile
    p = profile(run_dir, warmup=warmup)
    return {"generate": p["stages"]["generate"]["flops_per_s_busy"],
            "micro_steps": p["stages"]["train"]["flops"] / p["busy"]["micro_steps"] if p["busy"]["micro_steps"] else 0.0,
            "optimizer_s": p["busy"]["optimizer"]}


def run_project(work, setup: str, mode: str, steps: int, micro_batch: int, run_dir: str,
                account: bool = False, env_extra: dict | None = None) -> list[float]:
    model_dir, prompts, reward, budgets = work
    _, _, _, _, _, plen, new = SETUPS[setup]
    mode, _, malloc = mode.partition("@")     # MODE@system: glibc's own malloc settings (the opt-out)
    cmd = [sys.executable, "-m", "periodic_async", "--config", os.path.join(ROOT, "configs", "default.yaml"),
           f"model.path={model_dir}", "data.source=jsonl", f"data.path={prompts}", "data.chat_template=none",
           f"data.train_batch_size={PROMPTS_PER_STEP}", f"data.max_prompt_length={plen}", f"rollout.n={K}",
           f"rollout.max_new_tokens={new}", "rollout.ignore_eos=true", f"rollout.max_slots={PROMPTS_PER_STEP * K}",
           f"actor.micro_batch_size={micro_batch}", "actor.lr=3e-3", "actor.kl_coef=0",
           "reward.name=custom", f"reward.custom_file={reward}", "reward.num_workers=1",
           f"trainer.total_steps={steps}", "trainer.save_final=false", "trainer.save_every=0",
           "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.run_dir={run_dir}", *MODES[mode],
           *(["trainer.record_timeline=true"] if account else []),
           *(["data.max_new_tokens_key=n", "data.shuffle=false"] if budgets else [])]
    from periodic_async.backend_setup import host_malloc_env
    env = dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false", **host_malloc_env(malloc),
               **(env_extra or {}))
    _run(cmd, env, f"project {mode}" + (f"@{malloc}" if malloc else ""))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if "timing_s/step" in r]
    for r in recs:
        lens = step_lengths(budgets, r["step"], new)
        for key, want in (("response_length/min", min(lens)), ("response_length/max", max(lens)),
                          ("response_length/mean", statistics.fmean(lens)), ("prompt_length/mean", plen)):
            if abs(r.get(key, want) - want) > 1e-6:
                sys.exit(f"project {mode}: step {r['step']}: {key} = {r[key]}, expected {want}")
    return [r["timing_s/step"] for r in recs]


def _run(cmd: list[str], env: dict, what: str) -> None:
    """Run a side, echoing its per-step lines as progress; on failure, its output's tail."""
    t = time.perf_counter()
    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        tail = (tail + [line])[-80:]
        if line.startswith("[trl] step") or line.lstrip().startswith("step "):
            print(f"    {what}: {line.strip()[:160]}", flush=True)
    if proc.wait() != 0:
        sys.exit(f"{what} failed (rc {proc.returncode}): {' '.join(cmd)}\n{''.join(tail)}")
    log(f"  {what}: done in {time.perf_counter() - t:.0f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="small")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the measurement (the first W)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="periodic,sync_shared,periodic_shared",
                   help=f"project modes, from {','.join(MODES)}; MODE@system runs it with glibc's malloc "
                   "defaults (PERIODIC_ASYNC_HOST_MALLOC=system: the cpu backend's held heap off)")
    p.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward, both sides")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", default=None, help="put the table into this markdown file (docs/performance.md), "
                   "between markers named after the setups")
    p.add_argument("--keep-runs", default=None, help="keep every side's run directory under this one "
                   "(for tools/profile_run.py)")
    p.add_argument("--no-trl", action="store_true", help="the project's modes only")
    p.add_argument("--trl-held-heap", action="store_true",
                   help="add a TRL side run with the project's cpu malloc settings (glibc's MALLOC_* variables)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="keep TRL's default gradient checkpointing (off by default here: the project does not recompute)")
    p.add_argument("--table", default=None, help="also write the markdown table to this file")
    p.add_argument("--no-account", action="store_true", help="no FLOP/s account (no timeline, no matmul probe)")
    a = p.parse_args()
    if a.steps <= a.warmup:
        sys.exit("--steps must exceed --warmup")
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m.partition("@")[0] not in MODES or m.partition("@")[2] not in ("", "system"):
            sys.exit(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    py = None if a.no_trl else ensure_trl_venv()
    sides = ([] if a.no_trl else ["trl"] + (["trl_heap"] if a.trl_held_heap else [])) + modes
    rows, raw, account_rows = [], {}, []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import machine_load
    for setup in a.setups.split(","):
        hidden, layers, heads, kv, ffn, plen, new = SETUPS[setup]
        times = {s: [] for s in sides}
        stages = {s: [] for s in sides}
        loads = {s: [] for s in sides}      # machine_load.since per repeat: a slow repeat with steal was the VM's
        with (contextlib.nullcontext(os.path.join(a.keep_runs, setup)) if a.keep_runs
              else tempfile.TemporaryDirectory(prefix=f"bench_vs_trl_{setup}_")) as d:
            os.makedirs(d, exist_ok=True)
            work = make_work(d, setup, a.steps, a.seed)
            measured_lengths = [step_lengths(work[3], i, new) for i in range(a.warmup + 1, a.steps + 1)]
            # the mean tokens of a measured step (every side runs the same steps)
            step_tokens = statistics.fmean(sum(plen + n for n in step) for step in measured_lengths)
            if not a.no_account:
                from peak_flops import measure
                from sim.flops import ModelShape
                with open(os.path.join(work[0], "config.json")) as f:
                    shape = ModelShape.from_hf_config(json.load(f))
                train_rows = a.micro_batch * (plen + new)
                rates = measure(shape, [train_rows, PROMPTS_PER_STEP * K], a.threads)
                log(f"{setup}: matmul rate at the model's shapes: {rates['by_rows'][train_rows]['model_rate_flops'] / 1e9:.1f} "
                    f"GFLOP/s at {train_rows} rows, {rates['by_rows'][PROMPTS_PER_STEP * K]['model_rate_flops'] / 1e9:.1f} "
                    f"at {PROMPTS_PER_STEP * K}; peak {rates['peak_flops'] / 1e9:.1f}")
            log(f"{setup}: hidden {hidden}, {layers} layers, {heads}/{kv} heads, ffn {ffn}; prompt {plen} + "
                f"{new} tokens, {PROMPTS_PER_STEP}x{K} completions/step; {a.steps} steps, warm-up {a.warmup}, "
                f"{a.repeats} repeats")
            for rep in range(a.repeats):
                for side in sides:
                    log(f"{setup} repeat {rep + 1}/{a.repeats}: {side}")
                    run_dir = os.path.join(d, f"{side}_{rep}")
                    os.makedirs(run_dir, exist_ok=True)
                    before = machine_load.snapshot()
                    if side in ("trl", "trl_heap"):
                        st = run_trl(py, work, setup, a.steps, a.micro_batch, a.threads, run_dir,
                                     a.trl_gradient_checkpointing, held_heap=side == "trl_heap")
                    else:
                        st = run_project(work, setup, side, a.steps, a.micro_batch, run_dir, not a.no_account)
                        if not a.no_account:
                            stages[side].append(stage_account(run_dir, a.warmup))
                    if len(st) != a.steps:
                        sys.exit(f"{side}: {len(st)} step times, expected {a.steps}")
                    times[side].append(st[a.warmup:])
                    loads[side].append(machine_load.since(before))
                    log(f"  {side}: measured steps {', '.join(f'{x:.2f}' for x in st[a.warmup:])} s "
                        f"(warm-up {', '.join(f'{x:.2f}' for x in st[:a.warmup])} s); "
                        f"{machine_load.describe(loads[side][-1])}")
        ref = None
        for side in sides:
            per_rep = [step_tokens * len(t) / sum(t) for t in times[side]]
            allt = [x for t in times[side] for x in t]
            tps = step_tokens * len(allt) / sum(allt)
            if side == sides[0]:
                ref = tps
            med = statistics.median(allt)
            if side == sides[0]:
                ref_med = step_tokens / med
            steal = [x["steal_share"] for x in loads[side] if x["steal_share"] is not None]
            rows.append((setup, side, med, tps, min(per_rep), max(per_rep), tps / ref, step_tokens / med,
                         step_tokens / med / ref_med, max(steal) if steal else None))
        raw[setup] = {"step_s": times, "machine_load": loads}
        if not a.no_account:
            useful = useful_flops_per_step(shape, plen, measured_lengths)
            peak = rates["peak_flops"]
            decode_rate = rates["by_rows"][PROMPTS_PER_STEP * K]["model_rate_flops"]
            train_rate = rates["by_rows"][train_rows]["model_rate_flops"]
            floor = useful["generate"] / decode_rate + useful["train"] / train_rate
            for side in sides:
                med = statistics.median([x for t in times[side] for x in t])
                per_s = (useful["generate"] + useful["train"]) / med
                row = [setup, side, f"{per_s / 1e9:.1f} ({per_s / peak:.0%})", f"{floor:.2f}", f"{med / floor:.2f}x"]
                if stages[side]:
                    g = statistics.fmean(x["generate"] for x in stages[side])
                    m = statistics.fmean(x["micro_steps"] for x in stages[side])
                    o = statistics.fmean(x["optimizer_s"] for x in stages[side])
                    row += [f"{g / 1e9:.1f} ({g / decode_rate:.0%})", f"{m / 1e9:.1f} ({m / train_rate:.0%})", f"{o:.3f}"]
                else:
                    row += ["-", "-", "-"]
                account_rows.append((row, peak, decode_rate, train_rate))
    first = sides[0]
    lines = [f"| setup | side | step s (median) | tokens/s | tokens/s per repeat (min - max) | x {first} "
             f"| tokens/s at the median step | x {first} (median steps) | steal (max of repeats) |",
             "|---|---|---|---|---|---|---|---|---|"]
    names = {"trl": "TRL 1.16.0 GRPOTrainer", "trl_heap": "TRL 1.16.0, the project's malloc settings", "periodic": "project, periodic (default)",
             "sync_shared": "project, sync + shared_prompt", "periodic_shared": "project, periodic + shared_prompt",
             "sync": "project, sync"}
    for setup, side, med, tps, lo, hi, ratio, mtps, mratio, steal in rows:
        lines.append(f"| {setup} | {names.get(side, 'project, ' + side)} | {med:.2f} | {tps:.0f} | {lo:.0f} - {hi:.0f} | {ratio:.2f} "
                     f"| {mtps:.0f} | {mratio:.2f} | {'n/a' if steal is None else f'{steal:.1%}'} |")
    if account_rows:
        lines += ["", "FLOP/s account (useful FLOPs: generation + the policy's forward and backward; rates "
                  "measured by tools/peak_flops.py at the setup's shapes in this run):", "",
                  "| setup | side | step GFLOP/s (% of peak) | floor s | median step / floor | generation GFLOP/s busy "
                  "(% of the model rate at 64 rows) | micro-steps GFLOP/s busy (% of the model rate at training rows) "
                  "| optimizer s / step |", "|---|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row, *_ in account_rows]
        for setup in dict.fromkeys(r[0][0] for r in account_rows):
            peak, decode_rate, train_rate = next(r[1:] for r in account_rows if r[0][0] == setup)
            lines.append(f"\n{setup}: peak {peak / 1e9:.1f} GFLOP/s, model rate {decode_rate / 1e9:.1f} GFLOP/s at 64 "
                         f"rows, {train_rate / 1e9:.1f} at training rows.")
    table = "\n".join(lines)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"bench_vs_trl {stamp}: steps {a.steps}, warm-up {a.warmup}, repeats {a.repeats}, micro-batch "
              f"{a.micro_batch}, {a.threads} threads; tokens = prompt + completion, per completion, 64 completions per step")
    print("\n" + header + "\n\n" + table + "\n")
    if a.write_docs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from docblock import replace_block
        command = "python tools/bench_vs_trl.py " + " ".join(sys.argv[1:])
        replace_block(a.write_docs, f"bench-vs-trl-{'-'.join(a.setups.split(','))}",
                      [f"Command: `{command}`", "", header, "", table])
    if a.table:
        with open(a.table, "w") as f:
            f.write(header + "\n\n" + table + "\n")
        with open(os.path.splitext(a.table)[0] + ".json", "w") as f:   # the measured step times
            json.dump({"header": header, "by_setup": raw}, f, indent=1)


if __name__ == "__main__":
    main()
