"""The training loop. Mode `sync`: generate -> reward -> train -> sync weights, one batch per step.

Every rank runs this loop. Rank 0 owns the rollout engine and the reward workers, generates the
batch's groups and broadcasts them; each data-parallel rank trains on its share of the sequences
(gradient accumulation over micro-batches, loss normalised by the whole batch's token count);
after the optimizer step the policy's HF-layout weights stream into the rollout engine (version t+1)
before the next batch is generated, so every sample of batch t comes from policy t.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .algo import grpo
from .backend import get_backend
from .config import Config, config_to_dict
from .engine.actor import Actor
from .engine.batch import TrainSample, pack_unshared, split_micro_batches
from .metrics import MetricsLogger
from .models.mcore import spec_from_hf_dir
from .pipeline.group import Group, collect_groups
from .rollout.base import RolloutRequest, SamplingParams

log = logging.getLogger(__name__)


def request_seed(base_seed: int, step: int, group_index: int) -> int:
    """Sampling seed of one prompt: a function of (seed, step, prompt) only, never of batching."""
    return (base_seed * 1_000_003 + step) * 1_000_003 + group_index


@dataclass
class StepBatch:
    """What rank 0 broadcasts: the scored samples of one step and the rollout-side metrics."""
    samples: list[TrainSample]
    metrics: dict


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.backend = get_backend(cfg.backend)
        self.rank, self.world, self.local_rank = self.backend.init_distributed()
        self.device = self.backend.device(self.local_rank)
        cfg.validate(world_size=self.world)          # before any model is built
        self.model_dir = self._prepare_model_dir()
        self.spec = spec_from_hf_dir(self.model_dir)
        cfg.validate(world_size=self.world, num_heads=self.spec.num_heads,
                     num_kv_heads=self.spec.num_kv_heads, vocab_size=self.spec.vocab_size)
        self.backend.init_model_parallel(cfg.parallel.tensor_model_parallel_size,
                                         cfg.parallel.pipeline_model_parallel_size, cfg.trainer.seed)
        from megatron.core import parallel_state as ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

        from .data.dataset import PromptLoader, load_records
        from .models.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self.loader = PromptLoader(load_records(cfg.data), cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)

        self.actor = Actor(cfg.actor, self.spec, self.model_dir, cfg.model.dtype, self.device,
                           temperature=cfg.rollout.temperature or 1.0, with_reference=True)
        self.version = 0
        self.rollout = self.reward = None
        if self.rank == 0:
            from .reward.manager import RewardManager
            from .rollout.hf_engine import HFRolloutEngine
            self.reward = RewardManager(cfg.reward)
            self.rollout = HFRolloutEngine(self.model_dir, self.pad_id, self.eos_id,
                                           cfg.rollout.micro_batch_size, device=self.device)
        self.metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.tensorboard, enabled=self.rank == 0)
        self.sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k,
                                       cfg.rollout.max_new_tokens, (self.eos_id,) if self.eos_id is not None else ())

    # ------------------------------------------------------------------ set-up
    def _prepare_model_dir(self) -> str:
        if self.cfg.model.path:
            return self.cfg.model.path
        from .models.tiny import make_tiny_model_dir
        path = os.path.join(self.cfg.trainer.run_dir, "model_init")
        if self.rank == 0:
            make_tiny_model_dir(self.cfg.model.tiny, path, self.cfg.model.init_seed)
            with open(os.path.join(self.cfg.trainer.run_dir, "config.yaml"), "w") as f:
                import yaml
                yaml.safe_dump(config_to_dict(self.cfg), f, sort_keys=False)
        dist.barrier()
        return path

    def _tokenize_prompt(self, record) -> list[int]:
        ids = self.tokenizer(record.prompt, add_special_tokens=False).input_ids
        if len(ids) > self.cfg.data.max_prompt_length:
            raise ValueError(f"data: prompt of record {record.index} has {len(ids)} tokens, more than "
                             f"data.max_prompt_length={self.cfg.data.max_prompt_length}")
        if not ids:
            raise ValueError(f"data: prompt of record {record.index} is empty")
        return ids

    # ------------------------------------------------------------------ one step
    def generate_and_score(self, step: int) -> StepBatch:
        """Rank 0: generate K responses per prompt with the current policy, score, advantages."""
        cfg = self.cfg
        records = self.loader.next_batch()
        prompts = {i: (self._tokenize_prompt(r), r.answer) for i, r in enumerate(records)}
        sizes = {i: cfg.rollout.n for i in prompts}
        requests = [RolloutRequest(i, ids, sizes[i], self.sampling, request_seed(cfg.trainer.seed, step, i))
                    for i, (ids, _) in prompts.items()]
        t0 = time.perf_counter()
        groups = collect_groups(self.rollout.generate(requests), prompts, sizes)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        items = [(self.tokenizer.decode(r.response_ids, skip_special_tokens=True), g.answer)
                 for g in groups for r in g.results]
        scored = self.reward.score(items)
        t_reward = time.perf_counter() - t0
        it = iter(scored.scores)
        for g in groups:
            g.rewards = [next(it) for _ in g.results]
        advantages = grpo.group_advantages([g.rewards for g in groups])
        samples = []
        for g, adv in zip(groups, advantages):
            g.advantages = adv
            for r, a in zip(g.results, adv):
                if r.policy_version != self.version:
                    raise RuntimeError(f"sample of group {g.group_index} comes from policy version "
                                       f"{r.policy_version}, trainer is at {self.version}")
                samples.append(TrainSample(r.prompt_ids, r.response_ids, a, r.logprobs, r.policy_version))
        return StepBatch(samples, self._rollout_metrics(groups, scored, t_gen, t_reward))

    def _rollout_metrics(self, groups: list[Group], scored, t_gen: float, t_reward: float) -> dict:
        scores = torch.tensor([s for g in groups for s in g.rewards])
        adv = torch.tensor([a for g in groups for a in g.advantages])
        resp_len = torch.tensor([len(r.response_ids) for g in groups for r in g.results], dtype=torch.float)
        prompt_len = torch.tensor([len(g.prompt_ids) for g in groups], dtype=torch.float)
        truncated = sum(r.finish_reason == "length" for g in groups for r in g.results)
        solved = sum(max(g.rewards) >= 1.0 for g in groups)
        return {
            "critic/score/mean": scores.mean().item(), "critic/score/max": scores.max().item(),
            "critic/score/min": scores.min().item(), "critic/rewards/mean": scores.mean().item(),
            "critic/advantages/mean": adv.mean().item(), "critic/advantages/max": adv.max().item(),
            "critic/advantages/min": adv.min().item(),
            "response_length/mean": resp_len.mean().item(), "response_length/max": resp_len.max().item(),
            "response_length/min": resp_len.min().item(), "response_length/clip_ratio": truncated / len(resp_len),
            "prompt_length/mean": prompt_len.mean().item(),
            "rollout/solve_all_ratio": solved / len(groups),
            "reward/num_errors": scored.num_errors, "reward/num_timeouts": scored.num_timeouts,
            "timing_s/gen": t_gen, "timing_s/reward": t_reward,
        }

    def train_on(self, samples: list[TrainSample]) -> dict:
        """This DP rank's share of the batch: micro-steps (gradient accumulation), then one
        optimizer step. The loss normaliser covers the whole batch on every rank."""
        cfg = self.cfg.actor
        full_mask = [pack_unshared([s], self.pad_id).loss_mask for s in samples]
        if cfg.loss_agg_mode == "token-mean":
            normaliser = float(sum(m.sum() for m in full_mask))
        else:
            normaliser = float(len(samples))
        mine = samples[self.dp_rank::self.dp_size]
        sums: dict[str, float] = {}
        for chunk in split_micro_batches(mine, cfg.micro_batch_size):
            for k, v in self.actor.train_micro_step(pack_unshared(chunk, self.pad_id), normaliser).items():
                sums[k] = sums.get(k, 0.0) + v
        if self.dp_size > 1:
            from megatron.core import parallel_state as ps
            keys = sorted(sums)
            t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(t, group=ps.get_data_parallel_group())
            sums = dict(zip(keys, t.tolist()))
        sums.update(self.actor.optimizer_step())
        return sums

    def sync_weights(self) -> None:
        """Stream the new policy (HF layout) into the rollout engine as version t+1."""
        self.version += 1
        named = self.actor.export_weights()
        if self.rollout is not None:
            self.rollout.update_weights(named, self.version)
        else:
            for _ in named:   # other ranks take part in the TP gathers
                pass

    def step(self, step: int) -> dict:
        t_step = time.perf_counter()
        batch = [self.generate_and_score(step) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(batch, src=0)
        samples, metrics = batch[0].samples, dict(batch[0].metrics)
        t0 = time.perf_counter()
        metrics.update(self.train_on(samples))
        metrics["timing_s/update_actor"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.sync_weights()
        metrics["timing_s/update_weights"] = time.perf_counter() - t0
        metrics["timing_s/step"] = time.perf_counter() - t_step
        n_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / metrics["timing_s/step"] / self.world
        metrics["training/off_policy/trajectory_staleness/mean"] = float(
            sum(self.version - 1 - s.policy_version for s in samples) / len(samples))
        metrics["training/policy_version"] = self.version
        return metrics

    # ------------------------------------------------------------------ the run
    def fit(self) -> list[dict]:
        cfg = self.cfg.trainer
        history = []
        bar = None
        if self.rank == 0 and cfg.progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=cfg.total_steps, desc="GRPO", unit="step", dynamic_ncols=True)
        try:
            for step in range(1, cfg.total_steps + 1):
                metrics = self.step(step)
                history.append(metrics)
                line = self.metrics.log(step, metrics)
                if self.rank == 0:
                    if bar is not None:
                        bar.write(line)
                        bar.update(1)
                        bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
                    else:
                        print(line, flush=True)
            if self.cfg.trainer.save_final:
                self.save_hf(os.path.join(cfg.run_dir, "final_hf"))
        finally:
            if bar is not None:
                bar.close()
            self.close()
        return history

    def save_hf(self, out_dir: str) -> None:
        from .models.convert import save_hf_checkpoint
        named = self.actor.export_weights()
        if self.rank == 0:
            save_hf_checkpoint(named, self.model_dir, out_dir)
        else:
            for _ in named:
                pass
        dist.barrier()

    def close(self) -> None:
        self.metrics.close()
        if self.reward is not None:
            self.reward.close()
        if self.rollout is not None:
            self.rollout.close()
