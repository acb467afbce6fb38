"""Warm start for RL on a synthetic task: supervised fine-tuning of the tiny model up to a target
held-out accuracy, saved as a model directory that `model.path` loads.

The pilot-commit paper starts RL from a checkpoint at 20-40% accuracy; from the random-init tiny
model a binary exact-answer reward (countdown, `reward.name: exact`) almost never fires, so GRPO has
nothing to learn from. This tool builds the model the trainer builds for model.path null (the tiny
model of model.tiny with the task's alphabet; model.path itself is ignored), trains it by
next-token loss on the TRAINING records' (prompt, answer + EOS) pairs (the validation records the
trainer holds out, data.val_size, are never trained on), and every --eval-every steps samples
responses to the held-out prompts as the rollout does (rollout.temperature / top_k / top_p / max_new_tokens). It
stops at the first check with exact accuracy >= --target and saves the model there.

    .venv/bin/python tools/warm_start.py --config configs/countdown_warm.yaml --target 0.3 --out runs/warm/countdown
    ./run.sh --config configs/countdown_warm.yaml          # model.path: runs/warm/countdown
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from periodic_async.config import load_config  # noqa: E402
from periodic_async.data import prompts as prompt_render  # noqa: E402
from periodic_async.data.dataset import load_records  # noqa: E402
from periodic_async.data.synthetic import tiny_alphabet  # noqa: E402
from periodic_async.models.tiny import make_tiny_model_dir  # noqa: E402
from periodic_async.models.tokenizer import load_tokenizer, mark_char_tokenizer  # noqa: E402
from periodic_async.rollout.sampling import filter_logits_batch  # noqa: E402
from periodic_async.train.validation import split_validation  # noqa: E402


def load_start_model(cfg, scratch_dir: str):
    """(HF causal LM, tokenizer, whether the tokenizer is the project's char tokenizer): the tiny
    model the trainer builds for model.path null (model.tiny, model.init_seed, the task's alphabet),
    written into `scratch_dir` exactly as Trainer._prepare_run_dir does. model.path is not read: in
    a warm-start config it names this tool's output, which the RL run then loads."""
    from transformers import AutoModelForCausalLM
    path = make_tiny_model_dir(cfg.model.tiny, scratch_dir, cfg.model.init_seed, tiny_alphabet(cfg.data))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        is_char = bool(json.load(f).get("periodic_async_char_tokenizer"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_tokenizer(path), is_char


def encode_pairs(records, renderer, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids as the trainer renders them, answer ids + EOS) per record; prompts the renderer
    leaves out (data.overlong_prompt: skip) are left out here too."""
    pairs = []
    for r in records:
        prompt = renderer.render(r)
        if prompt is None:
            continue
        answer = list(tokenizer(r.answer, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
        pairs.append((prompt, answer))
    return pairs


def sft_batch(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels) [B, T], right-padded; labels are -100 except on the
    answer tokens, so only the response is learnt (the prompt is given at rollout)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(pairs):
        seq = p + a
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, len(p):len(seq)] = torch.tensor(a)
    return ids, mask, labels


def sft_loss(model, pairs, pad_id: int) -> torch.Tensor:
    ids, mask, labels = sft_batch(pairs, pad_id)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def batches(pairs, batch_size: int, seed: int) -> Iterator[list]:
    """Endless shuffled minibatches (a new permutation per epoch, deterministic in `seed`)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(pairs))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield [pairs[j] for j in order[i:i + batch_size]]


@torch.no_grad()
def sample_responses(model, prompts: list[list[int]], n: int, temperature: float, top_k: int, top_p: float,
                     max_new_tokens: int, eos_id: int, seed: int) -> list[list[int]]:
    """n sampled responses per prompt (EOS excluded), len(prompts) * n in prompt-major order.
    Prompts are batched by length (no padding needed: countdown's prompts all have 4 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[int, list[int]] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        rows = [i * n + k for i in idx for k in range(n)]
        seqs = torch.tensor([prompts[i] for i in idx for _ in range(n)])
        done = torch.zeros(len(rows), dtype=torch.bool)
        responses = [[] for _ in rows]
        past = None
        step_input = seqs
        for _ in range(max_new_tokens):
            res = model(input_ids=step_input, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1, :].float()
            if temperature > 0:
                logits = filter_logits_batch(logits / temperature, top_k, top_p)
                token = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
            else:
                token = logits.argmax(-1)
            for j in range(len(rows)):
                if not done[j]:
                    if int(token[j]) == eos_id:
                        done[j] = True
                    else:
                        responses[j].append(int(token[j]))
            if bool(done.all()):
                break
            step_input = token[:, None]
        out.update(zip(rows, responses))
    return [out[i] for i in range(len(prompts) * n)]


def exact_accuracy(model, tokenizer, prompts, answers, sampling, n: int, seed: int) -> float:
    """Share of sampled responses (n per held-out prompt) that decode to exactly the answer: the
    validation's mean@n under `reward.name: exact`."""
    was_training = model.training
    model.eval()
    responses = sample_responses(model, prompts, n, sampling.temperature, sampling.top_k, sampling.top_p,
                                 sampling.max_new_tokens, tokenizer.eos_token_id, seed)
    model.train(was_training)
    hits = sum(tokenizer.decode(r, skip_special_tokens=True).strip() == answers[i // n]
               for i, r in enumerate(responses))
    return hits / len(responses)


def train_until(step_fn: Callable[[int], float], accuracy_fn: Callable[[], float], target: float,
                eval_every: int, max_steps: int, log: Callable[[str], None] = print) -> tuple[int, float, bool]:
    """Run `step_fn(step)` (returns the loss) for steps 1.. and check `accuracy_fn()` before the first
    step and after every `eval_every`-th; stop at the first check >= target.
    Returns (steps taken, the last accuracy checked, whether the target was reached)."""
    acc = accuracy_fn()
    log(f"step 0: held-out accuracy {acc:.3f}")
    if acc >= target:
        return 0, acc, True
    for step in range(1, max_steps + 1):
        loss = step_fn(step)
        if step % eval_every == 0:
            acc = accuracy_fn()
            log(f"step {step}: loss {loss:.4f}, held-out accuracy {acc:.3f}")
            if acc >= target:
                return step, acc, True
    return max_steps, acc, False


def save_model_dir(model, tokenizer, out: str, is_char: bool) -> None:
    """A directory `model.path` loads: weights, config and tokenizer (tagged as the char tokenizer
    when it is one, so load_tokenizer does not hand it to AutoTokenizer)."""
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if is_char:
        mark_char_tokenizer(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="the model directory to write (give it to model.path)")
    ap.add_argument("--target", type=float, default=0.3, help="stop at the first check at or above this accuracy")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=5, help="SFT steps between accuracy checks")
    ap.add_argument("--eval-n", type=int, default=None, help="samples per held-out prompt (default trainer.val_n)")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="config key=value overrides, as for run.sh")
    args = ap.parse_args(argv)
    if not 0.0 < args.target <= 1.0:
        ap.error(f"--target: must be in (0, 1], got {args.target}")

    cfg = load_config(args.config, args.overrides)
    torch.manual_seed(args.seed)
    records, val_records = split_validation(load_records(cfg.data), cfg.data)
    if not val_records:
        print("error: data.val_size: warm_start needs held-out records to check accuracy on (set it > 0)",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        model, tokenizer, is_char = load_start_model(cfg, scratch)
    renderer = prompt_render.build(cfg.data, tokenizer)
    train_pairs = encode_pairs(records, renderer, tokenizer)
    val_pairs = encode_pairs(val_records, renderer, tokenizer)
    val_answers = [tokenizer.decode(a[:-1]) for _, a in val_pairs]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = args.eval_n or cfg.trainer.val_n
    print(f"warm start: {len(train_pairs)} training pairs, {len(val_pairs)} held-out prompts x {n} samples "
          f"(temperature {cfg.rollout.temperature}), target {args.target}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    stream = batches(train_pairs, min(args.batch_size, len(train_pairs)), args.seed)
    model.train()

    def step_fn(_step: int) -> float:
        loss = sft_loss(model, next(stream), pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def accuracy_fn() -> float:
        # the same draws at every check: two checks differ only by the model
        return exact_accuracy(model, tokenizer, [p for p, _ in val_pairs], val_answers, cfg.rollout, n, args.seed)

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {line}", flush=True)

    steps, acc, reached = train_until(step_fn, accuracy_fn, args.target, args.eval_every, args.max_steps, log)
    save_model_dir(model, tokenizer, args.out, is_char)
    verdict = "reached" if reached else "NOT reached"
    log(f"target {args.target} {verdict}: held-out accuracy {acc:.3f} after {steps} SFT steps; saved {args.out}")
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
