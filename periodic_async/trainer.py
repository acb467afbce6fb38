"""The training loop: one batch per step, in three modes (`trainer.mode`).

- periodic (default): a producer thread sends the batch's prompts to rollout worker processes;
  complete, scored groups arrive on a bounded queue and the trainer runs their micro-steps
  (gradient accumulation) in completion order while the rest still generate. The optimizer steps
  once the whole batch is consumed; the new weights reach every worker (version t+1) before the
  next batch is dispatched. Every sample of batch t comes from policy t.
- sync_split: the same worker/trainer split, but training starts after the whole batch is
  generated (the fair baseline for periodic).
- sync: the rollout engine lives in the trainer process (colocated baseline).

The three are the same computation: micro-steps sum unnormalised losses and the gradient is
scaled once by the batch's normaliser (its response-token or sequence count) before the
optimizer step, so the result does not depend on group arrival order or micro-batch split.

Every rank runs this loop. Rank 0 owns the rollout side and the reward workers and broadcasts each
group to the other ranks; data-parallel rank r trains on groups r, r + DP, r + 2 DP, ...
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed as dist

from .algo import grpo
from .backend import get_backend
from .config import Config, config_to_dict
from .engine.tri_model import TriModelEngine
from .engine.batch import TrainSample, pack_micro_batch
from .metrics import MetricsLogger
from .models.mcore import spec_from_hf_dir
from .pipeline.generator import ColocatedSource, Scorer, SourceStats, WorkerSource, make_plan
from .pipeline.group import Group
from .rollout.base import SamplingParams

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.backend = get_backend(cfg.backend)
        self.rank, self.world, self.local_rank = self.backend.init_distributed()
        cfg.validate(world_size=self.world)          # before any model is built
        self.model_dir = self._prepare_model_dir()
        self.spec = spec_from_hf_dir(self.model_dir)
        cfg.validate(world_size=self.world, num_heads=self.spec.num_heads,
                     num_kv_heads=self.spec.num_kv_heads, vocab_size=self.spec.vocab_size,
                     num_layers=self.spec.num_layers)
        self.backend.init_model_parallel(cfg.parallel.tensor_model_parallel_size,
                                         cfg.parallel.pipeline_model_parallel_size, cfg.trainer.seed)
        from megatron.core import parallel_state as ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # groups go from rank 0 to every rank on their own (gloo) group: see GroupFeed
        self.feed_group = dist.new_group(backend="gloo") if self.world > 1 else None

        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        worker_placements, trainer_placement = self.backend.rollout_placements(
            cfg.rollout.num_workers if cfg.trainer.mode != "sync" else 0, local_world)
        self.device = self.backend.enter_placement(trainer_placement, local_world) if self.backend.name == "cpu" \
            else self.backend.device(self.local_rank)

        from .data.dataset import PromptLoader, load_records
        from .models.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self.loader = PromptLoader(load_records(cfg.data), cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        self.sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k,
                                       cfg.rollout.max_new_tokens, (self.eos_id,) if self.eos_id is not None else ())

        self.actor = TriModelEngine(cfg.actor, self.spec, self.model_dir, cfg.model.dtype, self.device,
                           temperature=cfg.rollout.temperature or 1.0, with_reference=True)
        self.version = 0
        self.reward = self.source = None
        self.timeline: list[dict] = []
        # the workers' version 0: the policy's export, streamed into the pool's buffer on rank 0;
        # every rank takes part in the TP/PP gathers of the export
        initial = self.actor.export_weights() if cfg.trainer.mode != "sync" else None
        if self.rank == 0:
            self.source = self._build_source(worker_placements, initial)
        elif initial is not None:
            for _ in initial:
                pass
        self.metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.tensorboard, enabled=self.rank == 0)

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

    def _build_source(self, placements, initial):
        """initial: the policy's HF-layout (name, tensor) stream (version 0) for the workers; the
        pool consumes it whole before it starts them."""
        from .reward.manager import RewardManager
        cfg = self.cfg
        self.reward = RewardManager(cfg.reward)
        scorer = Scorer(self.reward, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        if cfg.trainer.mode == "sync":
            from .rollout.hf_engine import HFRolloutEngine
            engine = HFRolloutEngine(self.model_dir, self.pad_id, self.eos_id, cfg.rollout.max_slots, self.device)
            return ColocatedSource(engine, scorer)
        from .rollout.worker import WorkerPool, WorkerSpec
        spec = WorkerSpec(cfg.backend, self.model_dir, self.pad_id, self.eos_id, cfg.rollout.max_slots,
                          cfg.rollout.arrival_jitter_s, engine=cfg.rollout.engine,
                          max_model_len=cfg.rollout.max_model_len, load_format=cfg.rollout.load_format,
                          kv_cache_gb=cfg.rollout.vllm_kv_cache_gb, weight_sync=cfg.rollout.weight_sync,
                          bucket_bytes=int(cfg.actor.export_bucket_mb * (1 << 20)), dtype=cfg.model.dtype)
        from .models.convert import hf_layout
        from .models.mcore import torch_dtype
        pool = WorkerPool(spec, placements, hf_layout(self.spec), torch_dtype(cfg.model.dtype),
                          cfg.rollout.worker_timeout_s, initial_weights=initial)
        return WorkerSource(pool, scorer, cfg.rollout.queue_size, wait_for_batch=cfg.trainer.mode == "sync_split")

    def _tokenize_prompt(self, record) -> list[int]:
        ids = self.tokenizer(record.prompt, add_special_tokens=False).input_ids
        if len(ids) > self.cfg.data.max_prompt_length:
            raise ValueError(f"data: prompt of record {record.index} has {len(ids)} tokens, more than "
                             f"data.max_prompt_length={self.cfg.data.max_prompt_length}")
        if not ids:
            raise ValueError(f"data: prompt of record {record.index} is empty")
        return ids

    # ------------------------------------------------------------------ one step
    def _micro_batches(self, feed: "GroupFeed", n_groups: int, consumed: list, timing: dict):
        """Packed micro-batches of this DP rank's groups, in completion order, as they arrive:
        the engine's schedule pulls from here and blocks only when the next group is not done."""
        cfg = self.cfg
        pending: list[TrainSample] = []
        mbs = cfg.actor.micro_batch_size
        t_resume = None
        for i in range(n_groups):
            t0 = time.perf_counter()
            g = feed.get()
            timing["wait_s"] += time.perf_counter() - t0
            if g.policy_version != self.version:
                raise RuntimeError(f"group {g.group_index} was generated by policy version {g.policy_version}, "
                                   f"but the trainer is at version {self.version}: refusing an off-policy sample")
            consumed.append(g)
            if i % self.dp_size == self.dp_rank:
                pending += [TrainSample(r.prompt_ids, r.response_ids, a, r.logprobs, r.policy_version)
                            for r, a in zip(g.results, g.advantages)]
            while len(pending) >= mbs or (pending and i == n_groups - 1):
                mb = pack_micro_batch(pending[:mbs], self.pad_id, cfg.actor.shared_prompt)
                pending = pending[mbs:]
                t_yield = time.perf_counter()
                if t_resume is not None:
                    timing["train_intervals"].append((t_resume, t_yield))
                yield mb
                t_resume = time.perf_counter()
        timing["last_resume"] = t_resume

    def _num_micro_batches(self, n_groups: int) -> int:
        """Micro-batches this DP rank will run: known up front (the schedule needs the count)."""
        mine = len(range(self.dp_rank, n_groups, self.dp_size)) * self.cfg.rollout.n
        return -(-mine // self.cfg.actor.micro_batch_size)

    def step(self, step: int) -> dict:
        cfg = self.cfg
        t_step = time.perf_counter()
        n_groups = cfg.data.train_batch_size
        groups = None
        if self.rank == 0:
            plan = make_plan(step, self.loader.next_batch(), self._tokenize_prompt, cfg.rollout.n,
                             self.sampling, cfg.trainer.seed)
            self.source.start(plan)
            groups = self.source.groups()
        feed = GroupFeed(groups, n_groups, self.feed_group)
        self.actor.refresh_old()

        # Epoch 1: consume groups as they arrive (old == policy: the old forward is skipped)
        consumed: list[Group] = []
        timing = {"wait_s": 0.0, "train_intervals": [], "last_resume": None}
        keep = [] if cfg.actor.ppo_epochs > 1 else None
        stream = self._micro_batches(feed, n_groups, consumed, timing)
        if keep is not None:
            stream = _tee(stream, keep)
        n_mb = self._num_micro_batches(n_groups)
        t0 = time.perf_counter()
        sums = self.actor.forward_backward(stream, n_mb)
        leftover = sum(1 for _ in stream)
        feed.close()
        t_train_end = time.perf_counter()
        if timing["last_resume"] is not None:
            timing["train_intervals"].append((timing["last_resume"], t_train_end))
        if leftover:
            raise RuntimeError(f"the batch packed {n_mb + leftover} micro-batches on DP rank {self.dp_rank}, "
                               f"{n_mb} expected (are all groups of size rollout.n={cfg.rollout.n}?)")
        wait_s = timing["wait_s"]
        train_s = t_train_end - t0 - wait_s

        normaliser = grpo.batch_normaliser([len(r.response_ids) for g in consumed for r in g.results],
                                           cfg.actor.loss_agg_mode)
        metrics = {k: (v / normaliser if k.startswith("actor/") else v) for k, v in sums.items()}
        t0 = time.perf_counter()
        metrics.update(self.actor.optimizer_step(grad_scale=1.0 / normaliser))
        # Epochs 2..: replay the batch against the old policy (the policy at the batch's start)
        for _ in range(cfg.actor.ppo_epochs - 1):
            more = self.actor.forward_backward(keep, len(keep), use_old=True)
            step_metrics = self.actor.optimizer_step(grad_scale=1.0 / normaliser)
            for k, v in more.items():
                if k.startswith("actor/"):
                    metrics[k] += v / normaliser
            metrics["actor/grad_norm"] += step_metrics["actor/grad_norm"]
        if cfg.actor.ppo_epochs > 1:   # means over the epochs
            for k in list(metrics):
                if k.startswith("actor/") and k != "actor/lr":
                    metrics[k] /= cfg.actor.ppo_epochs
        train_s += time.perf_counter() - t0
        metrics["timing_s/update_actor"] = train_s

        t_sync = time.perf_counter()
        self.sync_weights()
        t_sync_end = time.perf_counter()
        metrics["timing_s/update_weights"] = t_sync_end - t_sync
        metrics["timing_s/step"] = t_sync_end - t_step
        metrics["trainer/idle_ratio"] = wait_s / metrics["timing_s/step"]
        if self.rank == 0:
            metrics.update(self._rollout_metrics(consumed, self.source.stats, metrics["timing_s/step"]))
            stats = self.source.stats
            overlap = max(0.0, stats.gen_s + train_s - (t_train_end - stats.t_dispatch))
            metrics["perf/overlap_s"] = overlap
            metrics["perf/overlap_ratio"] = overlap / max(1e-9, min(stats.gen_s, train_s))
            if cfg.trainer.record_timeline:
                self._record_timeline(step, stats, timing["train_intervals"], (t_sync, t_sync_end), t_step)
        n_tokens = sum(len(r.prompt_ids) + len(r.response_ids) for g in consumed for r in g.results)
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / metrics["timing_s/step"] / self._num_devices()
        metrics["training/off_policy/trajectory_staleness/mean"] = float(
            sum(self.version - 1 - r.policy_version for g in consumed for r in g.results)
            / sum(g.size for g in consumed))
        metrics["training/policy_version"] = self.version
        return metrics

    def _num_devices(self) -> int:
        """Trainer ranks plus rollout workers: throughput is per device of the whole job."""
        return self.world + (self.cfg.rollout.num_workers if self.cfg.trainer.mode != "sync" else 0)

    def _rollout_metrics(self, groups: list[Group], stats: SourceStats, step_s: float) -> dict:
        scores = torch.tensor([s for g in groups for s in g.rewards])
        adv = torch.tensor([a for g in groups for a in g.advantages])
        resp_len = torch.tensor([len(r.response_ids) for g in groups for r in g.results], dtype=torch.float)
        prompt_len = torch.tensor([len(g.prompt_ids) for g in groups], dtype=torch.float)
        truncated = sum(r.finish_reason == "length" for g in groups for r in g.results)
        busy: dict[int, list[tuple[float, float]]] = {}
        for r in stats.results:
            busy.setdefault(r.timings.get("worker", 0), []).append((r.timings["start"], r.timings["end"]))
        n_engines = max(1, self.cfg.rollout.num_workers if self.cfg.trainer.mode != "sync" else 1)
        busy_s = sum(_union_length(iv) for iv in busy.values()) / n_engines
        return {
            "critic/score/mean": scores.mean().item(), "critic/score/max": scores.max().item(),
            "critic/score/min": scores.min().item(), "critic/rewards/mean": scores.mean().item(),
            "critic/advantages/mean": adv.mean().item(), "critic/advantages/max": adv.max().item(),
            "critic/advantages/min": adv.min().item(),
            "response_length/mean": resp_len.mean().item(), "response_length/max": resp_len.max().item(),
            "response_length/min": resp_len.min().item(), "response_length/clip_ratio": truncated / len(resp_len),
            "prompt_length/mean": prompt_len.mean().item(),
            "rollout/solve_all_ratio": sum(max(g.rewards) >= 1.0 for g in groups) / len(groups),
            "reward/num_errors": stats.num_errors, "reward/num_timeouts": stats.num_timeouts,
            "timing_s/gen": stats.gen_s, "timing_s/reward": stats.reward_s,
            "rollouter/idle_ratio": max(0.0, 1.0 - busy_s / step_s),
            "rollouter/restarts": getattr(getattr(self.source, "pool", None), "restarts", 0),
        }

    def _record_timeline(self, step, stats: SourceStats, train_intervals, sync_interval, t_step) -> None:
        for r in stats.results:
            self.timeline.append({"step": step, "kind": "generate", "lane": f"worker{r.timings.get('worker', 0)}"
                                  f"/slot{r.timings['slot']}", "start": r.timings["start"], "end": r.timings["end"]})
        for a, b in train_intervals:
            self.timeline.append({"step": step, "kind": "train", "lane": "trainer", "start": a, "end": b})
        self.timeline.append({"step": step, "kind": "update_weights", "lane": "trainer",
                              "start": sync_interval[0], "end": sync_interval[1]})

    def sync_weights(self) -> None:
        """Stream the new policy (HF layout) to the rollout side as version t+1; returns once
        every engine holds it."""
        self.version += 1
        named = self.actor.export_weights()
        if self.source is not None:
            self.source.update_weights(named, self.version)
        else:
            for _ in named:   # other ranks take part in the TP gathers
                pass

    # ------------------------------------------------------------------ the run
    def fit(self) -> list[dict]:
        cfg = self.cfg.trainer
        history = []
        bar = None
        if self.rank == 0 and cfg.progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=cfg.total_steps, desc=f"GRPO ({cfg.mode})", unit="step", dynamic_ncols=True)
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
            if cfg.record_timeline and self.rank == 0:
                with open(os.path.join(cfg.run_dir, "timeline.jsonl"), "w") as f:
                    for event in self.timeline:
                        f.write(json.dumps(event) + "\n")
            if cfg.save_final:
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
        if self.source is not None:
            self.source.close()
            self.source = None
        if self.reward is not None:
            self.reward.close()
            self.reward = None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end] intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _tee(iterator, keep: list):
    """Yield from `iterator`, keeping a copy of every item in `keep` (for the later PPO epochs)."""
    for item in iterator:
        keep.append(item)
        yield item


class GroupFeed:
    """The batch's groups on EVERY rank, in rank 0's completion order.

    Rank 0 owns the rollout side; with more than one rank a thread on each rank takes part in one
    object broadcast per group on a dedicated gloo group, so feeding never interleaves with the
    training collectives (pipeline p2p, TP all-reduces) on the main thread - a pipeline stage
    waiting for activations would otherwise deadlock against a stage waiting in a broadcast. An
    error on rank 0's side is broadcast too, so every rank raises instead of waiting forever."""

    def __init__(self, groups, n_groups: int, group):
        import queue
        import threading
        self.n = n_groups
        self._iter = groups
        self._q = None
        if dist.get_world_size() > 1:
            self._q = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(groups, group), daemon=True,
                                            name="group-feed")
            self._thread.start()

    def _run(self, groups, group) -> None:
        try:
            for _ in range(self.n):
                box = [None]
                if dist.get_rank() == 0:
                    try:
                        box = [next(groups)]
                    except Exception as e:   # noqa: BLE001 - handed to every rank below
                        box = [_FeedError(f"{type(e).__name__}: {e}")]
                        self._q.put(e)
                        dist.broadcast_object_list(box, src=0, group=group)
                        return
                dist.broadcast_object_list(box, src=0, group=group)
                self._q.put(box[0] if not isinstance(box[0], _FeedError) else RuntimeError(
                    f"rank 0's rollout side failed: {box[0].message}"))
                if isinstance(box[0], _FeedError):
                    return
            if dist.get_rank() == 0:
                _expect_end(groups)
        except Exception as e:   # noqa: BLE001
            self._q.put(e)

    def get(self):
        if self._q is None:
            return next(self._iter)
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        if self._q is None:
            if self._iter is not None:
                _expect_end(self._iter)
            return
        self._thread.join()


class _FeedError:
    def __init__(self, message: str):
        self.message = message


def _expect_end(groups) -> None:
    for _ in groups:   # drain the end-of-batch marker
        raise RuntimeError("the rollout source produced more groups than the batch has prompts")
