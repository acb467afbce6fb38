"""Validation: the policy scored on held-out prompts, before training and every trainer.val_every
steps.

It runs between batches, after the weight sync, on the rollout side (the workers, or the
colocated engine in sync mode), so the workers hold exactly the policy being judged and the
trainer only waits for it. Per prompt: one greedy response and `trainer.val_n` sampled ones at
the rollout temperature, with seeds fixed across validations (the same prompts and draws each
time, so two validations differ only by the policy). Metrics, verl's `val-core/` style:
    val-core/{source}/reward/greedy@1    mean reward of the greedy responses
    val-core/{source}/reward/mean@{n}    mean reward of the sampled responses
    val-core/{source}/reward/best@{n}    mean over prompts of the best of n (pass@n for 0/1 rewards)
    timing_s/testing                     the validation's wall time
"""
from __future__ import annotations

import dataclasses
import time

from ..rollout.base import RolloutRequest, SamplingParams, with_budget
from ..scheduling.plan import request_seed

VAL_SEED_OFFSET = 7919      # validation draws never coincide with a training step's


def split_validation(records: list, data_cfg) -> tuple[list, list]:
    """(training records, validation records): data.val_path's records (same format as data.path)
    when set, else the last data.val_size records of the training data, held out with every other
    record of the same prompt."""
    if data_cfg.val_path:
        from ..data.dataset import load_records
        return records, load_records(dataclasses.replace(data_cfg, path=data_cfg.val_path))
    n = data_cfg.val_size
    if n <= 0:
        return records, []
    if n >= len(records):
        from ..data.records import DatasetError
        raise DatasetError(f"data.val_size: {n} held-out records leave none of the {len(records)} to train on")
    held = records[-n:]
    prompts = {r.prompt for r in held}
    # a prompt that also occurs earlier (synthetic data repeats prompts) is not trained on either
    return [r for r in records[:-n] if r.prompt not in prompts], held


class Validator:
    def __init__(self, records: list, tokenize, sampling: SamplingParams, n: int, seed: int, source: str):
        self.records, self.tokenize, self.n, self.source = records, tokenize, n, source
        prompts = [tokenize(r) for r in records]
        greedy = dataclasses.replace(sampling, temperature=0.0)
        m = len(records)
        # group indices: greedy i, sampled m + i (one dispatch, unique keys)
        budgets = [r.max_new_tokens for r in records]
        self.requests = ([RolloutRequest(i, p, 1, with_budget(greedy, b), request_seed(seed + VAL_SEED_OFFSET, 0, i))
                          for i, (p, b) in enumerate(zip(prompts, budgets))] +
                         [RolloutRequest(m + i, p, n, with_budget(sampling, b), request_seed(seed + VAL_SEED_OFFSET, 1, i))
                          for i, (p, b) in enumerate(zip(prompts, budgets))])

    def run(self, producer, reward, decode) -> dict[str, float]:
        """Generate through `producer.generate_eval`, score with the reward manager."""
        t0 = time.perf_counter()
        results = sorted(producer.generate_eval(self.requests), key=lambda r: (r.group_index, r.sample_index))
        m = len(self.records)
        answers = [self.records[r.group_index % m].answer for r in results]
        scores = reward.score([(decode(r.response_ids), a) for r, a in zip(results, answers)]).scores
        greedy = [0.0] * m
        sampled: list[list[float]] = [[] for _ in range(m)]
        for r, s in zip(results, scores):
            if r.group_index < m:
                greedy[r.group_index] = s
            else:
                sampled[r.group_index - m].append(s)
        key = f"val-core/{self.source}/reward"
        return {f"{key}/greedy@1": sum(greedy) / m,
                f"{key}/mean@{self.n}": sum(sum(s) for s in sampled) / (m * self.n),
                f"{key}/best@{self.n}": sum(max(s) for s in sampled) / m,
                "timing_s/testing": time.perf_counter() - t0}
