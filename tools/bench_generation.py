"""Generation speed of the HF rollout engine (rollout/hf_engine.py) against the engine it replaced
(a frozen copy below: per-row sampling, finished rows kept in the batch, the whole active set
re-prefilled at every refill, each prompt prefilled K times) and transformers' `generate` (what TRL
does: one static batch, sampled). "new engine" decodes with rollout/lean_decode.py (the default);
"hf decode" is the same engine with decode="hf" (each decode step through the transformers forward);
with --compiled, "compiled" is the engine with compile_decode=True (rollout.compile_decode), its
compile left out of the timed runs and printed.

A random-init Qwen2 ("small": hidden 256, 4 layers, 4 heads / 2 KV heads, ffn 1024; vocabulary of
the char tokenizer unless --vocab), fp32, on the CPU with --threads torch threads. No EOS and no
stop tokens, so lengths are exactly the requested ones. Two cases:
- fixed: --prompts prompts x K=--k, --prompt-len tokens each, exactly --new tokens per response,
  all rows in one batch (max_slots = prompts * K);
- variable: prompts of 16..128 tokens, max_new_tokens per request from a long-tailed distribution
  (Pareto), fewer slots than sequences, so slots are refilled while others decode. `generate`
  gets one static batch of every row, decoded to the longest length (the tokens past a row's own
  length are not counted).
The engines alternate, --repeats times; times are the best run's, of the wall clock and of this
process's CPU time (all threads; steadier than the wall clock when other processes share the
cores, but it counts OpenMP threads' spin-waiting too).

    python tools/bench_generation.py                   # both cases, ~1.5 min on 2 idle cores
    python tools/bench_generation.py --case fixed --repeats 1

The fixed case ends with the new engine's FLOP/s account (issue 30): its prefill and decode
seconds per run (HFRolloutEngine.phase_s: the model calls alone), the rest of the run (sampling,
cache bookkeeping, Python), each phase's GFLOP/s (tools/sim/flops.py) and its share of the matmul
rate at the model's shapes measured here (tools/peak_flops.py: the prefill's rows, 64 decode rows).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_TOOLS))       # the repo root, for periodic_async

import torch  # noqa: E402

from periodic_async.rollout.base import RolloutRequest, RolloutResult, SamplingParams, sample_seed  # noqa: E402
from periodic_async.rollout.hf_engine import HFRolloutEngine  # noqa: E402


# ---------------------------------------------------------------------- the old engine (frozen copy)
def _old_filter_logits(logits, top_k, top_p):
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


@dataclass
class _OldSeq:
    request: RolloutRequest
    k: int
    generator: torch.Generator
    slot: int = -1
    out_ids: list = field(default_factory=list)
    out_lp: list = field(default_factory=list)
    t_start: float = 0.0
    done: bool = False
    reason: str = "length"

    @property
    def tokens(self):
        return self.request.prompt_ids + self.out_ids


class OldHFRolloutEngine(HFRolloutEngine):
    """hf_engine.HFRolloutEngine as of commit bc37220 (its __init__ / serve / _prefill / _sample)."""

    def __init__(self, model_dir, pad_token_id, eos_token_id, max_slots=256, device="cpu"):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.max_slots = max_slots
        self.policy_version = 0

    @torch.no_grad()
    def serve(self, poll, initial=(), on_slots=None):
        pending = deque()

        def admit(reqs):
            for r in reqs or ():
                for k in r.samples():
                    pending.append(_OldSeq(r, k, torch.Generator().manual_seed(sample_seed(r.seed, k))))

        admit(initial)
        slots = [None] * self.max_slots
        past = None
        rows = []
        attn = pos = next_ids = None
        while True:
            new = poll()
            admit(new)
            free = [i for i, s in enumerate(slots) if s is None]
            if pending and free:
                now = time.perf_counter()
                for i in free:
                    if not pending:
                        break
                    seq = pending.popleft()
                    seq.slot, seq.t_start = i, now
                    slots[i] = seq
                past = None
            rows_now = [s for s in slots if s is not None]
            if not rows_now:
                if new is None and not pending:
                    return
                time.sleep(0.001)
                continue
            if past is None:
                rows = rows_now
                logits, past, attn, pos = self._old_prefill(rows)
            else:
                out = self.model(input_ids=next_ids, attention_mask=attn, position_ids=pos, past_key_values=past,
                                 use_cache=True)
                past, logits = out.past_key_values, out.logits[:, -1, :].float().cpu()
            next_tok = torch.full((len(rows),), self.pad_token_id, dtype=torch.long)
            finished = []
            for i, seq in enumerate(rows):
                if seq.done:
                    continue
                tok = self._old_sample(seq, logits[i])
                next_tok[i] = tok
                sp = seq.request.sampling
                if tok in sp.stop_token_ids or tok == self.eos_token_id:
                    seq.done, seq.reason = True, "stop"
                elif len(seq.out_ids) >= sp.max_new_tokens:
                    seq.done = True
                if seq.done:
                    finished.append(seq)
            t_end = time.perf_counter()
            for seq in finished:
                slots[seq.slot] = None
            if finished:
                yield [RolloutResult(s.request.group_index, s.k, list(s.request.prompt_ids), s.out_ids, s.out_lp,
                                     s.reason, self.policy_version, {"start": s.t_start, "end": t_end, "slot": s.slot})
                       for s in finished]
            if all(s.done for s in rows):
                past = None
                continue
            next_ids = next_tok[:, None].to(self.device)
            pos = pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=self.device)], dim=1)

    def _old_prefill(self, rows):
        lens = [len(s.tokens) for s in rows]
        width = max(lens)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, s in enumerate(rows):
            ids[i, width - lens[i]:] = torch.tensor(s.tokens)
            attn[i, width - lens[i]:] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float().cpu(), out.past_key_values, attn, pos

    @staticmethod
    def _old_sample(seq, logits):
        sp = seq.request.sampling
        if sp.temperature == 0:
            tok = int(logits.argmax())
            lp = float(torch.log_softmax(logits, -1)[tok])
        else:
            scaled = logits / sp.temperature
            probs = _old_filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1)
            tok = int(torch.multinomial(probs, 1, generator=seq.generator))
            lp = float(torch.log_softmax(scaled, -1)[tok])
        seq.out_ids.append(tok)
        seq.out_lp.append(lp)
        return tok



# ---------------------------------------------------------------------- the cases
def fixed_requests(a, vocab):
    rng = random.Random(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.new)
    return [RolloutRequest(i, [rng.randrange(1, vocab) for _ in range(a.prompt_len)], a.k, sp, 1000 + i)
            for i in range(a.prompts)]


def variable_requests(a, vocab):
    """Long-tailed response lengths: 8 * Pareto(1.2), capped at --var-max-new."""
    rng = random.Random(1)
    out = []
    for i in range(a.var_prompts):
        n_new = min(a.var_max_new, int(8 * rng.paretovariate(1.2)))
        p_len = rng.randint(16, 128)
        out.append(RolloutRequest(i, [rng.randrange(1, vocab) for _ in range(p_len)], a.var_k,
                                  SamplingParams(temperature=1.0, max_new_tokens=n_new), 2000 + i))
    return out


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t0):
    """(wall seconds, CPU seconds of this process: all its threads) since t0 = _clock()."""
    t1 = _clock()
    return t1[0] - t0[0], t1[1] - t0[1]


def run_engine(engine, reqs):
    t0 = _clock()
    res = list(engine.generate(reqs))
    dt = _since(t0)
    toks = sum(len(r.response_ids) for r in res)
    assert toks == sum(r.sampling.max_new_tokens * r.n for r in reqs), "responses are not of the requested length"
    return dt, toks


@torch.no_grad()
def run_hf_generate(model, reqs):
    """One static batch of every (prompt, k) row, left-padded, sampled to the longest length."""
    rows = [r.prompt_ids for r in reqs for _ in range(r.n)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    n_new = max(r.sampling.max_new_tokens for r in reqs)
    t0 = _clock()
    out = model.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         min_new_tokens=n_new, max_new_tokens=n_new, pad_token_id=0)
    dt = _since(t0)
    assert out.shape[1] == width + n_new
    return dt, sum(r.sampling.max_new_tokens * r.n for r in reqs)    # the tokens the rows asked for


def bench(name, contenders, reqs, repeats):
    times = {n: [] for n in contenders}
    toks = {}
    for rep in range(repeats):
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))   # alternate
        for n in order:
            dt, toks[n] = contenders[n](reqs)
            times[n].append(dt)
            print(f"  run {rep + 1}: {n:<12} {dt[0]:6.2f} s wall, {dt[1]:6.2f} s CPU", flush=True)
    # the best run: other processes on the same cores only ever add time
    wall = {n: min(t[0] for t in v) for n, v in times.items()}
    cpu = {n: min(t[1] for t in v) for n, v in times.items()}
    print(f"\n{name}: {len(reqs)} prompts, {sum(r.n for r in reqs)} sequences, "
          f"{toks['new engine']} response tokens")
    print(f"  {'':<12} {'wall s':>7} {'tok/s':>7} {'/new':>6}   {'CPU s':>7} {'tok/CPU s':>9} {'/new':>6}   "
          "runs (wall/CPU s)")
    for n in contenders:
        print(f"  {n:<12} {wall[n]:7.2f} {toks[n] / wall[n]:7.0f} {wall[n] / wall['new engine']:6.2f}   "
              f"{cpu[n]:7.2f} {toks[n] / cpu[n]:9.0f} {cpu[n] / cpu['new engine']:6.2f}   "
              + ", ".join(f"{w:.2f}/{c:.2f}" for w, c in times[n]))
    return wall, cpu, {n: [t[0] for t in v] for n, v in times.items()}


def account(a, vocab: int, engine, mean_wall: float) -> None:
    """The new engine's phases per run of the fixed case, as seconds, GFLOP/s and share of the model rate."""
    sys.path.insert(0, _TOOLS)
    from peak_flops import dense_shape, measure
    from sim.flops import forward_flops, generation_flops
    shape = dense_shape(a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, vocab)
    rows = a.prompts * a.k
    prefill_rows = a.prompts * a.prompt_len
    rates = measure(shape, [prefill_rows, rows], a.threads)["by_rows"]
    prefill_s, decode_s = (engine.phase_s[k] / a.repeats for k in ("prefill", "decode"))
    flops = {"prefill": a.prompts * forward_flops(shape, a.prompt_len),
             "decode": rows * (generation_flops(shape, a.prompt_len, a.new) - forward_flops(shape, a.prompt_len))}
    print(f"\nnew engine, FLOP/s account (fixed case; seconds per run, mean over {a.repeats} runs of "
          f"{mean_wall:.2f} s):")
    for phase, secs, rate in (("prefill", prefill_s, rates[prefill_rows]), ("decode", decode_s, rates[rows])):
        got = flops[phase] / secs if secs else 0.0
        print(f"  {phase:8s} {secs:6.3f} s  {flops[phase] / 1e9:7.3f} GFLOP  {got / 1e9:6.1f} GFLOP/s  "
              f"{got / rate['model_rate_flops']:5.0%} of the model rate at {prefill_rows if phase == 'prefill' else rows} "
              f"rows ({rate['model_rate_flops'] / 1e9:.1f} GFLOP/s)")
    print(f"  rest     {mean_wall - prefill_s - decode_s:6.3f} s  (sampling, cache bookkeeping, Python: the run "
          f"minus the phases)")
    floor = flops["prefill"] / rates[prefill_rows]["model_rate_flops"] + flops["decode"] / rates[rows]["model_rate_flops"]
    print(f"  floor    {floor:6.3f} s  (both phases at the model rate); run / floor {mean_wall / floor:.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=["fixed", "variable", "both"], default="both")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=0, help="0: the char tokenizer's")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--var-prompts", type=int, default=16)
    p.add_argument("--var-k", type=int, default=4)
    p.add_argument("--var-max-new", type=int, default=128)
    p.add_argument("--var-slots", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compiled", action="store_true", help="add the engine with rollout.compile_decode (its "
                   "compile is done in an untimed run of each case's requests first)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import Qwen2ForCausalLM
    from periodic_async.models.tiny import make_random_model_dir
    from periodic_async.models.tokenizer import build_char_tokenizer
    vocab = a.vocab or len(build_char_tokenizer())
    with tempfile.TemporaryDirectory() as d:
        make_random_model_dir(d, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, vocab, max_positions=1024,
                              eos_token_id=None)
        hf = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
        engines = {}
        for slots_case, slots in (("fixed", a.prompts * a.k), ("variable", a.var_slots)):
            engines[slots_case] = {"new engine": HFRolloutEngine(d, 0, None, max_slots=slots),
                                   "hf decode": HFRolloutEngine(d, 0, None, max_slots=slots, decode="hf"),
                                   "old engine": OldHFRolloutEngine(d, 0, None, max_slots=slots)}
            if a.compiled:
                engines[slots_case]["compiled"] = HFRolloutEngine(d, 0, None, max_slots=slots, compile_decode=True)
    print(f"model: Qwen2 hidden {a.hidden}, {a.layers} layers, {a.heads} heads / {a.kv_heads} KV heads, ffn {a.ffn}, "
          f"vocab {vocab}, fp32, {torch.get_num_threads()} torch threads; best of {a.repeats}")
    warm = [RolloutRequest(0, [1, 2, 3], 2, SamplingParams(max_new_tokens=4), 0)]
    for case in engines.values():
        for eng in case.values():
            list(eng.generate(warm))
    run_hf_generate(hf, warm)

    def contenders(case):
        out = {n: (lambda r, e=e: run_engine(e, r)) for n, e in engines[case].items()}
        out["hf generate"] = lambda r: run_hf_generate(hf, r)
        return out

    if a.compiled:      # compile (and recompile for these shapes) outside the timed runs
        for case, reqs in (("fixed", fixed_requests(a, vocab)), ("variable", variable_requests(a, vocab))):
            if a.case not in (case, "both"):
                continue
            t = time.perf_counter()
            list(engines[case]["compiled"].generate(reqs))
            print(f"compiled engine, {case} case: first run (compiling) {time.perf_counter() - t:.1f} s", flush=True)
    results = {}
    if a.case in ("fixed", "both"):
        new_engine = engines["fixed"]["new engine"]
        new_engine.phase_s = {k: 0.0 for k in new_engine.phase_s}          # the warm-up's out
        results["fixed"] = bench(f"fixed: {a.prompts} x K={a.k}, prompt {a.prompt_len}, exactly {a.new} new tokens, "
                                 f"{a.prompts * a.k} slots", contenders("fixed"), fixed_requests(a, vocab), a.repeats)
        account(a, vocab, new_engine, sum(results["fixed"][2]["new engine"]) / a.repeats)
    if a.case in ("variable", "both"):
        reqs = variable_requests(a, vocab)
        lens = sorted(r.sampling.max_new_tokens for r in reqs)
        print(f"\nvariable: max_new_tokens per request {lens}")
        results["variable"] = bench(f"variable: {a.var_prompts} x K={a.var_k}, prompts 16..128, {a.var_slots} slots",
                                    contenders("variable"), reqs, a.repeats)
    return results


if __name__ == "__main__":
    main()
