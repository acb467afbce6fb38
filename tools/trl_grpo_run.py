"""One TRL GRPOTrainer run for tools/bench_vs_trl.py; runs in the TRL venv (.venv-trl), not the project's.

    .venv-trl/bin/python tools/trl_grpo_run.py --model-dir DIR --prompts prompts.jsonl --reward reward.py
        --steps N --out times.json [--micro-batch 16] [--prompts-per-step 8] [--k 8] [--new-tokens 64]

Trains the HF checkpoint in DIR with GRPO (HF generate, no vLLM), fp32 on the CPU, beta 0 (no
reference model), one optimizer step per 8 prompts x K=8 completions, every completion exactly
--new-tokens long (min_new_tokens = max_new_tokens), or with --budgets exactly its prompt's "n"
tokens from the prompts file (EOS masked before the budget's last token and forced at it, so the
completion is n - 1 sampled tokens and EOS; prompts in file order, as the project takes them with
data.shuffle=false). The reward is reward.py's
compute_score(response, answer), the same function the project's run uses. Writes the wall time
of each optimizer step (a TrainerCallback: time between consecutive step ends, the first from the
start of training) to --out as JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time


def force_budgets(model, budget_of: dict, prompt_len: int, eos: int) -> None:
    """Every generate() of `model` ends each row at its prompt's budget: a logits processor masks
    EOS before the budget's last token and leaves only EOS at it (TRL's own generate call, with
    the processor added: GRPOTrainer passes no logits_processor of its own)."""
    import functools

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Budgets(LogitsProcessor):
        n = None        # (rows,) the budgets of this generate call's rows, read at its first step

        def __call__(self, input_ids, scores):
            done = input_ids.shape[1] - prompt_len             # tokens generated so far
            if done == 0:
                self.n = torch.tensor([budget_of[tuple(r)] for r in input_ids[:, :prompt_len].tolist()])
            scores[done < self.n - 1, eos] = -float("inf")
            at = done == self.n - 1
            scores[at] = -float("inf")
            scores[at, eos] = 0.0
            return scores

    model.generate = functools.partial(type(model).generate, model, logits_processor=LogitsProcessorList([Budgets()]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompts", required=True, help="jsonl with a 'question' field per line")
    p.add_argument("--reward", required=True, help="a .py file with compute_score(response, answer)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--budgets", action="store_true", help="each prompt's completions are its row's 'n' tokens long")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="TRL's default (GRPOConfig turns it on); off here unless given, as the project does not recompute")
    a = p.parse_args()

    import torch
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("bench_reward", a.reward)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def reward(completions, **kwargs):
        return [float(mod.compute_score(c, None)) for c in completions]

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    with open(a.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [r["question"] for r in rows]
    for s in prompts:
        n = len(tok(s, add_special_tokens=False)["input_ids"])
        if n != a.prompt_len or len(tok(s)["input_ids"]) != a.prompt_len:
            raise SystemExit(f"prompt {s!r} is {n} tokens, not {a.prompt_len}")
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    if a.budgets:
        force_budgets(model, {tuple(tok(r["question"], add_special_tokens=False)["input_ids"]): int(r["n"]) for r in rows},
                      a.prompt_len, tok.eos_token_id)
    per_step = a.prompts_per_step * a.k
    if per_step % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} does not divide {per_step}")
    cfg = GRPOConfig(
        output_dir=a.run_dir, num_generations=a.k, per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=per_step // a.micro_batch, generation_batch_size=per_step,
        max_completion_length=a.new_tokens, generation_kwargs={} if a.budgets else {"min_new_tokens": a.new_tokens},
        shuffle_dataset=not a.budgets,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, num_iterations=1,
        max_steps=a.steps, bf16=False, fp16=False, use_cpu=True, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, seed=a.seed, disable_tqdm=True,
        gradient_checkpointing=a.gradient_checkpointing)

    times: list[float] = []
    lengths: list[float] = []
    all_logs: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            times.append(now - self.t)
            self.t = now
            print(f"[trl] step {state.global_step}: {times[-1]:.2f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])
            if logs:
                all_logs.append(dict(logs))

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    with open(a.out, "w") as f:
        json.dump({"step_s": times, "mean_completion_length": lengths, "threads": torch.get_num_threads(), "logs": all_logs}, f)


if __name__ == "__main__":
    main()
