"""The training loop: build everything, then one batch per step, in four modes (`trainer.mode`;
scheduling/mode.py makes each a value, and every one runs through the one producer core,
scheduling/producer.py).

- periodic (default): a producer thread sends the batch's prompts to rollout worker processes;
  complete, scored groups arrive on a bounded queue and the trainer runs their micro-steps
  (gradient accumulation, train/step.py) in completion order while the rest still generate. The
  optimizer steps once the whole batch is consumed; the new weights reach every worker (version
  t+1) before the next batch is dispatched. Every sample of batch t comes from policy t.
- sync_split: the same worker/trainer split, but training starts after the whole batch is
  generated (the fair baseline for periodic).
- sync: the rollout engine lives in the trainer process (colocated baseline).
- async: bounded staleness (trainer.max_staleness = eta). The producer dispatches batch b as soon
  as the workers hold version b - 1 - eta, so generation runs up to eta batches ahead of training;
  new weights are posted without waiting and reach the workers mid-generation (every token tagged
  with its version). Batch b is still trained at step b, at version b - 1. eta = 0 is periodic.

The first three are the same computation (train/step.py says why); async is too at eta = 0.
Every rank runs this loop; rank 0 owns the rollout side and the reward workers and feeds every
group to the other ranks (train/feed.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch.distributed as dist

from ..actor.tri_model import TriModelActor
from ..backend import get_backend
from ..config import Config, config_to_dict
from ..models.mcore import arch_from_hf_dir
from ..data.synthetic import tiny_alphabet
from ..models.tiny import tiny_arch
from ..rollout.base import SamplingParams
from ..scheduling.dp_assignment import TokenBudget
from ..scheduling.mode import Mode
from ..scheduling.scorer import reward_fault_summary
from ..telemetry import step_metrics
from ..telemetry.logger import MetricsLogger
from ..telemetry.sample_trace import SampleTrace
from ..telemetry.timeline import Timeline
from .feed import GroupFeed
from .startup_checks import check_registries_and_warn
from .step import train_batch

log = logging.getLogger(__name__)


class NonFiniteTraining(RuntimeError):
    """trainer.max_nonfinite_steps steps in a row had a non-finite gradient norm."""


def drain(named_tensors) -> None:
    """Consume a weight export on a rank that has nowhere to send it: every rank takes part in the
    export's TP/PP gathers."""
    for _ in named_tensors:
        pass


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        arch = self._validated_arch()
        self._records, self._val_records = self._read_inputs()    # rank 0's loader's; None elsewhere
        self.backend = get_backend(cfg.backend)
        self.memory_plan = self._check_memory(arch)
        self.mode = Mode.of(cfg.trainer.mode, cfg.trainer.max_staleness, cfg.trainer.stream_slack)
        self.rank, self.world, self.local_rank = self.backend.init_distributed()
        self.model_dir = self._prepare_run_dir()
        self.arch = arch_from_hf_dir(self.model_dir)
        self.dp_rank, self.dp_size, self.feed_group = self._init_model_parallel()
        worker_placements, self.core_seat, self.device = self._place_processes()
        self.tokenizer, self.prompts = self._load_tokenizer_and_prompts()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self.staleness = self.mode.staleness
        self._importance_baseline = self._uses_importance_baseline()
        self.token_budget = TokenBudget.of(cfg, whole_groups=self._importance_baseline)
        self.actor = self._build_actor()
        self.version = 0
        self.start_step = 0             # the last step done (a resumed run's checkpoint step)
        self.nonfinite_in_a_row = 0
        self.reward = self.producer = self.planner = self.sample_trace = None
        self.timeline = Timeline()
        meta = self._resume()
        self._start_rollout(worker_placements, meta)    # rank 0: self.planner, self.producer, self.reward
        self.metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.tensorboard, enabled=self.rank == 0,
                                     resume_after_step=self.start_step if meta is not None else None,
                                     loggers=cfg.trainer.logger, project=cfg.trainer.project_name,
                                     experiment=cfg.trainer.experiment_name, config=dataclasses.asdict(cfg),
                                     wandb_mode=cfg.trainer.wandb_mode,
                                     mlflow_tracking_uri=cfg.trainer.mlflow_tracking_uri)
        self.sample_trace = (SampleTrace(cfg.trainer.run_dir, self.start_step)
                             if cfg.trainer.record_samples and self.rank == 0 else None)
        self.validator = self._build_validator()

    def validate(self) -> dict[str, float]:
        """Validation metrics of the policy the rollout side holds now (rank 0; {} elsewhere)."""
        if self.validator is None:
            return {}
        return self.validator.run(self.producer, self.reward, self.producer.scorer.decode)

    # ------------------------------------------------------------------ set-up
    def _validated_arch(self):
        """The model's architecture (the checkpoint's config.json, or the tiny model's), after the
        config is validated against it: once, before anything is started or written."""
        cfg = self.cfg
        arch = arch_from_hf_dir(cfg.model.path) if cfg.model.path else tiny_arch(cfg.model.tiny, tiny_alphabet(cfg.data))
        cfg.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")), num_heads=arch.num_heads,
                     num_kv_heads=arch.num_kv_heads, vocab_size=arch.vocab_size, num_layers=arch.num_layers)
        check_registries_and_warn(cfg)
        return arch

    def _read_inputs(self) -> tuple[list | None, list | None]:
        """(training records, validation records) on rank 0, (None, None) on the other ranks.
        Every rank reads the checkpoint's headers and the dataset before anything is started, so
        that a missing file or a bad row stops every rank with the same one-line error (__main__),
        not rank 0 alone halfway through set-up while the others wait on it."""
        cfg = self.cfg
        if cfg.model.path:
            from ..models.convert import check_checkpoint
            check_checkpoint(cfg.model.path)
        from ..data.dataset import check_budgets, load_records
        from .validation import split_validation
        records, val_records = split_validation(load_records(cfg.data), cfg.data)
        check_budgets(records, cfg.data, cfg.data.path, cfg.rollout.max_new_tokens)
        check_budgets(val_records, cfg.data, cfg.data.val_path or cfg.data.path, cfg.rollout.max_new_tokens)
        if int(os.environ.get("RANK", "0")) != 0:
            return None, None
        return records, val_records

    def _init_model_parallel(self):
        """Megatron's TP x PP x DP groups and RNG; returns (DP rank, DP size, the feed group: groups
        go from rank 0 to every rank on their own gloo group, train/feed.py; None on one rank)."""
        parallel = self.cfg.parallel
        self.backend.init_model_parallel(parallel.tensor_model_parallel_size,
                                         parallel.pipeline_model_parallel_size, self.cfg.trainer.seed)
        from megatron.core import parallel_state as ps
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        feed_group = dist.new_group(backend="gloo") if self.world > 1 else None
        return dp_rank, dp_size, feed_group

    def _place_processes(self):
        """Where this node's rollout workers (modes with the engine in workers) and trainer ranks
        run: returns (the workers' placements, this rank's CoreSeat or None, its device)."""
        cfg = self.cfg
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        worker_placements, trainer_placement = self.backend.rollout_placements(
            cfg.rollout.num_workers if self.mode.engine_in_workers else 0, local_world,
            share_cores=cfg.rollout.cpu_cores == "shared" and cfg.rollout.engine == "hf",
            devices_per_worker=cfg.rollout.tensor_parallel_size)
        seat = trainer_placement.get("seat")     # cpu, shared cores: see backend.CoreSeat
        device = self.backend.trainer_device(trainer_placement, self.local_rank, local_world)
        return worker_placements, seat, device

    def _load_tokenizer_and_prompts(self):
        """(the model directory's tokenizer, the prompt renderer of data/prompts.py on it)."""
        from ..models.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(self.model_dir)
        from ..data import prompts
        return tokenizer, prompts.build(self.cfg.data, tokenizer, where=f"the tokenizer of {self.model_dir}")

    def _uses_importance_baseline(self) -> bool:
        """Whether the advantage estimator uses importance ratios (vcpo_baseline): it is applied in
        the loss, where the proximal policy's log-probs are, so the samples carry rewards and groups
        there."""
        from ..algo import ADV_ESTIMATORS
        return getattr(ADV_ESTIMATORS.lookup(self.cfg.algo.adv_estimator), "uses_importance_ratios", False)

    def _build_actor(self) -> TriModelActor:
        cfg = self.cfg
        return TriModelActor(cfg.actor, self.arch, self.model_dir, cfg.model.dtype, self.device,
                             temperature=cfg.rollout.temperature or 1.0,
                             with_reference=cfg.actor.uses_reference,
                             pad_token_id=self.pad_id)

    def _start_rollout(self, worker_placements, meta: dict | None) -> None:
        """Rank 0 builds the planner (restored from a checkpoint's `meta`) and the producer with
        its pool; every rank takes part in the weight exports that give the rollout side the
        policy's weights."""
        # the workers' first weights: the policy's export (version 0, or the checkpoint's),
        # streamed into the pool's buffer on rank 0
        initial = self.actor.export_weights() if self.mode.engine_in_workers else None
        if self.rank == 0:
            self.planner = self._build_planner()
            if meta is not None:
                self.planner.load_state_dict(meta)
            self.producer = self._build_producer(worker_placements, initial)
            if self.cfg.trainer.record_timeline:
                self.timeline.watch_scorer(self.producer.scorer)
        elif initial is not None:
            drain(initial)
        if not self.mode.engine_in_workers and self.version > 0:
            named = self.actor.export_weights()     # the colocated engine starts from the checkpoint
            if self.producer is not None:
                self.producer.update_weights(named, self.version)
            else:
                drain(named)

    def _build_validator(self):
        """The Validator on rank 0 with trainer.val_every and validation records; else None."""
        cfg = self.cfg
        if not (self.rank == 0 and cfg.trainer.val_every and self._val_records):
            return None
        from .validation import Validator
        return Validator(self._val_records, self._tokenize_prompt, self.planner.sampling,
                         cfg.trainer.val_n, cfg.trainer.seed, cfg.data.source)

    def _layout(self) -> dict:
        from megatron.core import parallel_state as ps
        return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
                "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
                "data_parallel_size": self.dp_size}

    def _resume(self) -> dict | None:
        """Load trainer.resume's checkpoint into the actor and the step counters; returns its meta
        (None when starting fresh)."""
        from .checkpoint import load_checkpoint, resolve_resume
        path = resolve_resume(self.cfg.trainer.resume, self.cfg.trainer.run_dir)
        if path is None:
            return None
        meta, loaded = load_checkpoint(path, self.rank, self._layout(), self.actor.sharded_state_dict())
        self.actor.load_sharded_state_dict(loaded)
        self.version, self.start_step = int(meta["version"]), int(meta["step"])
        self.nonfinite_in_a_row = int(meta.get("nonfinite_in_a_row", 0))
        if self.rank == 0:
            log.info("resumed from %s (step %d, policy version %d)", path, self.start_step, self.version)
        return meta

    def save_checkpoint(self, step: int) -> str:
        """A checkpoint of the state after `step` (collective: every rank calls it)."""
        from .checkpoint import save_checkpoint
        # the planner (loader, group sizer, allocator) as it was before batch step + 1, which may
        # be in flight already; None on the other ranks
        planner = (self.producer.planner_state(step) if self.producer is not None
                   else {"loader": None, "group_sizer": None, "allocator": None})
        meta = {"version": self.version, "layout": self._layout(), "nonfinite_in_a_row": self.nonfinite_in_a_row,
                **planner, "config": config_to_dict(self.cfg)}
        return save_checkpoint(self.cfg.trainer.run_dir, step, self.rank, self.world,
                               self.actor.sharded_state_dict(), meta, self.cfg.trainer.keep_checkpoints)

    def _check_memory(self, arch):
        """Refuse, before anything is started or built, a config that cannot fit a device
        (memory_plan.py: model state exact, activations and KV cache estimated); every rank plans
        the whole job, so every rank refuses alike. No limit on the cpu backend: returns None."""
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        trainer_memory = self.backend.device_memory_bytes(int(os.environ.get("LOCAL_RANK", "0")))
        if trainer_memory is None:
            return None
        from ..memory_plan import plan_memory
        # workers take the devices after the trainer's (backend.rollout_placements), when there
        worker_memory = (self.backend.device_memory_bytes(local_world)
                         if local_world < self.backend.device_count() else trainer_memory)
        plan = plan_memory(self.cfg, arch, trainer_memory, worker_memory,
                           world_size=int(os.environ.get("WORLD_SIZE", "1")), local_world_size=local_world)
        plan.check()
        if int(os.environ.get("RANK", "0")) == 0:
            log.info("memory plan: %s", plan.verdict())
        return plan

    def _prepare_run_dir(self) -> str:
        """Rank 0 writes config.yaml (every run) and, without model.path, the tiny model; returns
        the model directory."""
        path = self.cfg.model.path or os.path.join(self.cfg.trainer.run_dir, "model_init")
        if self.rank == 0:
            import yaml
            os.makedirs(self.cfg.trainer.run_dir, exist_ok=True)
            with open(os.path.join(self.cfg.trainer.run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(config_to_dict(self.cfg), f, sort_keys=False)
            if not self.cfg.model.path:
                from ..models.tiny import make_tiny_model_dir
                make_tiny_model_dir(self.cfg.model.tiny, path, self.cfg.model.init_seed, tiny_alphabet(self.cfg.data))
        dist.barrier()
        return path

    def _build_planner(self):
        from ..data.dataset import PromptLoader
        from ..scheduling.plan import BatchPlanner
        cfg = self.cfg
        loader = PromptLoader(self._records, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        stops = (self.eos_id,) if self.eos_id is not None and not cfg.rollout.ignore_eos else ()
        sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k,
                                  cfg.rollout.max_new_tokens, stops, ignore_eos=cfg.rollout.ignore_eos)
        from ..scheduling.group_sizing import build_group_sizer
        from ..scheduling.selection import build_selection
        selection = build_selection(cfg.rollout, cfg.data.train_batch_size, cfg.rollout.n, len(loader.records),
                                    max_staleness=self.mode.max_staleness)
        return BatchPlanner(loader, self._tokenize_prompt, sampling, cfg.trainer.seed,
                            group_sizer=build_group_sizer(cfg.rollout), default_n=cfg.rollout.n, selection=selection)

    def _build_producer(self, placements, initial):
        """initial: the policy's HF-layout (name, tensor) stream (version 0) for the workers; the
        pool consumes it whole before it starts them."""
        from ..reward.manager import RewardManager
        from ..scheduling.producer import Producer
        from ..scheduling.scorer import Scorer
        cfg = self.cfg
        self.reward = RewardManager(cfg.reward)
        buffer = cfg.reward.overlong_buffer
        scorer = Scorer(self.reward, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                        cfg.algo.adv_estimator, cfg.algo,
                        (cfg.rollout.max_new_tokens, buffer.len, buffer.penalty_factor) if buffer.len else None)
        if self.mode.engine_in_workers:
            pool = self._build_pool(placements, initial)
        else:
            from ..rollout.colocated import ColocatedPool
            from ..rollout.hf_engine import HFRolloutEngine
            pool = ColocatedPool(HFRolloutEngine(self.model_dir, self.pad_id, self.eos_id, cfg.rollout.max_slots,
                                                 self.device, compile_decode=cfg.rollout.compile_decode))
        return Producer(pool, scorer, self.planner, self.mode, first_step=self.start_step + 1,
                        last_step=cfg.trainer.total_steps, prompt_counts=self.prompts.pop_counts,
                        queue_size=cfg.rollout.queue_size, batch_size=cfg.data.train_batch_size)

    def _build_pool(self, placements, initial):
        cfg = self.cfg
        from ..models.convert import hf_layout
        from ..models.mcore import torch_dtype
        from ..rollout.worker import WorkerPool, WorkerSettings
        settings = WorkerSettings(cfg.backend, self.model_dir, self.pad_id, self.eos_id, cfg.rollout.max_slots,
                                  cfg.rollout.arrival_jitter_s, engine=cfg.rollout.engine,
                                  max_model_len=cfg.rollout.max_model_len, load_format=cfg.rollout.load_format,
                                  kv_cache_gb=cfg.rollout.vllm_kv_cache_gb,
                                  gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, weight_sync=cfg.rollout.weight_sync,
                                  bucket_bytes=int(cfg.actor.export_bucket_mb * (1 << 20)), dtype=cfg.model.dtype,
                                  interruptible=cfg.rollout.interruptible,
                                  tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                                  enforce_eager=cfg.rollout.enforce_eager, compile_decode=cfg.rollout.compile_decode)
        pool = WorkerPool(settings, placements, hf_layout(self.arch), torch_dtype(cfg.model.dtype),
                          cfg.rollout.worker_timeout_s, initial_weights=initial, staleness=self.staleness,
                          remote_workers=cfg.rollout.remote_workers, remote_address=cfg.rollout.remote_address,
                          initial_version=self.version)
        return pool

    def _tokenize_prompt(self, record) -> list[int] | None:
        """The record's prompt ids (data/prompts.py); None: leave it out (data.overlong_prompt: skip)."""
        return self.prompts.render(record)

    # ------------------------------------------------------------------ one step
    def _check_group(self, group) -> None:
        self.staleness.check(f"group {group.group_index}", group.policy_versions, self.version)

    def step(self, step: int) -> dict:
        cfg = self.cfg
        t_step = time.perf_counter()
        sizes = groups = None
        if self.rank == 0:
            plan, prompt_counts = self.producer.batch(step)     # dispatched once the weights allow it
            sizes, groups = plan.train_sizes, self.producer.groups(step)
        feed = GroupFeed(sizes, groups, self.feed_group)
        batch = train_batch(self.actor, feed, cfg.actor, self.dp_rank, self.dp_size, self._check_group,
                            seat=self.core_seat, with_rewards=self._importance_baseline,
                            loss_scale_factor=cfg.actor.loss_scale_factor or cfg.rollout.max_new_tokens,
                            budget=self.token_budget,
                            rewards_by_std=self._importance_baseline and cfg.algo.norm_adv_by_std_in_grpo)
        t_batch_end = time.perf_counter()
        metrics = dict(batch.metrics)
        metrics["timing_s/update_actor"] = batch.train_s

        t_sync = time.perf_counter()
        self.sync_weights()
        if self.core_seat is not None:
            # idle from here: the workers may start the next batch (its prefill is one long engine
            # step) as soon as they hold the weights, and take the trainer's cores only if it says so
            self.core_seat.set_busy(False)
        t_sync_end = time.perf_counter()
        step_s = t_sync_end - t_step
        metrics["timing_s/update_weights"] = t_sync_end - t_sync
        metrics["timing_s/step"] = step_s
        metrics["trainer/idle_ratio"] = batch.wait_s / step_s
        trained = [g for g in batch.groups if g.size]   # without the empty groups of unfilled positions
        if self.rank == 0:
            if self.sample_trace is not None:
                pool = self.producer.pool
                self.sample_trace.record(step, trained, pool.pids(), pool.restarts)
            stats, batch_metrics = self.producer.batch_done(step)
            metrics.update(prompt_counts)
            metrics.update(batch_metrics)      # the plan's (allocation) and the group sizer's
            metrics.update(step_metrics.rollout_metrics(
                trained, stats, step_s, num_engines=self._num_engines(), restarts=self.producer.pool.restarts))
            reward_faults = reward_fault_summary(stats, len(stats.results))
            if reward_faults:
                log.warning("step %d: %s", step, reward_faults)
            metrics.update(step_metrics.overlap_metrics((stats.t_dispatch, stats.t_last_group),
                                                        batch.train_intervals))
            if cfg.trainer.record_timeline:
                self.timeline.record_step(
                    step, stats.results, batch.train_intervals, (t_sync, t_sync_end), (t_step, t_sync_end),
                    trained, self.token_budget or cfg.actor.micro_batch_size, self.dp_size, t_batch_end,
                    {"mode": cfg.trainer.mode, "devices": self._num_devices(), "engines": self._num_engines(),
                     "world": self.world, "dp_size": self.dp_size, "micro_batch_size": cfg.actor.micro_batch_size,
                     "dispatch": stats.t_dispatch, "gen_end": stats.t_last_group})
        metrics.update(step_metrics.throughput_metrics(trained, step_s, self._num_devices(), self.version))
        metrics["training/policy_version"] = self.version
        return metrics

    def _num_devices(self) -> int:
        """Trainer ranks plus rollout workers: throughput is per device of the whole job. Local
        workers sharing the trainer's CPU cores (backend.CoreSeat) add no device."""
        if not self.mode.engine_in_workers:
            return self.world
        local = 0 if self.core_seat is not None else self.cfg.rollout.num_workers
        return self.world + local + self.cfg.rollout.remote_workers

    def _num_engines(self) -> int:
        """Rollout engines: the trainer's own in sync mode, else the local and remote workers."""
        if not self.mode.engine_in_workers:
            return 1
        return self.cfg.rollout.num_workers + self.cfg.rollout.remote_workers

    def sync_weights(self) -> None:
        """Stream the new policy (HF layout) to the rollout side as version t+1; returns once
        every engine holds it (async: once it is in the workers' buffer and posted to them)."""
        self.version += 1
        named = self.actor.export_weights()
        if self.producer is not None:
            self.producer.update_weights(named, self.version)
        else:
            drain(named)

    # ------------------------------------------------------------------ the run
    def fit(self) -> list[dict]:
        cfg = self.cfg.trainer
        history = []
        bar = None
        if self.rank == 0 and cfg.progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=cfg.total_steps, desc=f"GRPO ({cfg.mode})", unit="step", dynamic_ncols=True)
        skipped_in_a_row = self.nonfinite_in_a_row
        if bar is not None:
            bar.update(self.start_step)
        from .stop import STOP
        STOP.in_loop = True
        try:
            if self.validator is not None and self.start_step == 0:
                self.metrics.log(0, self.validate())          # before training
            for step in range(self.start_step + 1, cfg.total_steps + 1):
                metrics = self.step(step)
                if self.validator is not None and step % cfg.val_every == 0:
                    metrics.update(self.validate())           # the policy after this step's sync
                history.append(metrics)
                skipped_in_a_row = skipped_in_a_row + 1 if metrics["actor/step_skipped"] else 0
                self.nonfinite_in_a_row = skipped_in_a_row
                metrics["trainer/nonfinite_steps_in_a_row"] = skipped_in_a_row
                line = self.metrics.log(step, metrics)
                if skipped_in_a_row:
                    log.warning("step %d: gradient norm %s is not finite; the update was skipped (%d in a row)",
                                step, metrics["actor/grad_norm"], skipped_in_a_row)
                if skipped_in_a_row >= cfg.max_nonfinite_steps:
                    raise NonFiniteTraining(
                        f"{skipped_in_a_row} steps in a row (up to step {step}) had a non-finite gradient norm and "
                        f"were skipped (trainer.max_nonfinite_steps={cfg.max_nonfinite_steps}); the policy is "
                        "unchanged since. Check the learning rate, the rewards and model.dtype; metrics are in "
                        f"{os.path.join(cfg.run_dir, 'metrics.jsonl')}")
                if self.rank == 0:
                    if bar is not None:
                        bar.write(line)
                        bar.update(1)
                        bar.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
                    else:
                        print(line, flush=True)
                # after the step's metrics line: a checkpoint never runs ahead of metrics.jsonl
                saved = cfg.save_every and step % cfg.save_every == 0
                if saved:
                    self.save_checkpoint(step)
                if self._stop_requested(STOP.requested):
                    if not saved:
                        self.save_checkpoint(step)
                    raise KeyboardInterrupt(f"stopped after step {step} (checkpoint written)")
            if cfg.record_timeline and self.rank == 0:
                self.timeline.write(os.path.join(cfg.run_dir, "timeline.jsonl"))
            if cfg.save_final:
                self.save_hf(os.path.join(cfg.run_dir, "final_hf"))
        finally:
            STOP.in_loop = False
            if bar is not None:
                bar.close()
            self.close()
        return history

    def _stop_requested(self, mine: bool) -> bool:
        """Whether any rank got a stop signal: all ranks stop at the same boundary (one tiny
        all-reduce per step on the gloo feed group)."""
        if self.world == 1:
            return mine
        import torch
        flag = torch.tensor([1 if mine else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.feed_group)
        return bool(flag.item())

    def save_hf(self, out_dir: str) -> None:
        from ..models.convert import save_hf_checkpoint
        named = self.actor.export_weights()
        if self.rank == 0:
            save_hf_checkpoint(named, self.model_dir, out_dir)
        else:
            drain(named)
        dist.barrier()

    def close(self) -> None:
        self.metrics.close()
        if self.sample_trace is not None:
            self.sample_trace.close()
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        if self.reward is not None:
            self.reward.close()
            self.reward = None
