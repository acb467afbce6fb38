"""Megatron-core GPTModel for Qwen2 / Qwen2.5 / Llama checkpoints.

`ModelArch` is the architecture read from a Hugging Face `config.json`; `build_gpt_model` maps it
onto Megatron-core's local layer spec (RMSNorm, SwiGLU, RoPE, GQA, optional QKV bias), the same
mapping on every backend. The core-attention module is selectable: torch SDPA (the default, with the
training fast paths of kernels/fast_layers: RoPE, SwiGLU and RMSNorm in fewer passes),
Megatron's local DotProductAttention (the local spec as is), or shared-prompt attention
(kernels/shared_prompt, docs/shared-prompt.md).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .hf_config import CheckpointError, read_hf_config  # noqa: F401 - CheckpointError re-exported

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `model.dtype` config value."""
    return _DTYPES[name]


class UnsupportedModel(InputError):
    """The checkpoint's architecture or a config field is not supported; the message says which."""


class UnsupportedMegatronCore(RuntimeError):
    """The installed megatron-core is outside the series this code is written against."""


# megatron-core >= 0.16.0, < 0.17 (setup.py says the same). `PositionRopeGPTModel` overrides
# GPTModel._preprocess, which takes `padding_mask` from 0.16.0 and does not exist in 0.12 - there the
# override would never run and RoPE would silently ignore the position ids; ProcessGroupCollection
# arrives in 0.15 and SharedPromptCoreAttention does not fit 0.13 / 0.14's attention.
MEGATRON_CORE_SERIES = (0, 16)


def check_megatron_core(version: str | None = None) -> str:
    """The installed megatron-core version (or `version`); UnsupportedMegatronCore unless 0.16.x."""
    if version is None:
        from megatron.core import package_info
        version = package_info.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) != MEGATRON_CORE_SERIES:
        raise UnsupportedMegatronCore(
            f"megatron-core {version} is installed; periodic-async needs megatron-core >= 0.16.0, < 0.17 "
            "(GPTModel._preprocess with padding_mask: on older cores the position-id RoPE would silently not "
            "apply). On Ascend use Megatron-LM core_r0.16.0 with MindSpeed's core_r0.16.0 branch; MindSpeed's "
            "releases target core_r0.12.1, which is not supported (docs/running-on-910b.md)")
    return version


@dataclass(frozen=True)
class ModelArch:
    arch: str                 # qwen2 | llama
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool
    eos_token_id: int | None = None


def arch_from_hf_dir(path: str) -> ModelArch:
    c, cfg_file = read_hf_config(path)
    return arch_from_hf_dict(c, source=cfg_file)


def arch_from_hf_dict(c: dict, source: str = "config.json") -> ModelArch:
    model_type = c.get("model_type")
    if model_type not in ("qwen2", "llama"):
        raise UnsupportedModel(f"{source}: model_type '{model_type}' is not supported; allowed: qwen2, llama")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UnsupportedModel(f"{source}: rope scaling '{rope_type}' is not supported yet; allowed: default")
    # A config.json written by transformers 5 with the 4.x key too (or the reverse) must agree on
    # the base: transformers 4.x reads only `rope_theta`, 5.x only `rope_parameters`.
    if "rope_theta" in rope and "rope_theta" in c and float(rope["rope_theta"]) != float(c["rope_theta"]):
        raise UnsupportedModel(f"{source}: rope_theta {c['rope_theta']} disagrees with rope_parameters.rope_theta "
                               f"{rope['rope_theta']} (transformers 4.x uses the first, 5.x the second)")
    if c.get("use_sliding_window"):
        raise UnsupportedModel(f"{source}: use_sliding_window=true is not supported")
    # Megatron is built with add_bias_linear=False: a bias on o_proj or the MLP cannot be loaded.
    if model_type == "llama" and c.get("attention_bias"):
        raise UnsupportedModel(f"{source}: attention_bias=true (bias on q/k/v and o_proj) is not supported; "
                               "allowed: false")
    if c.get("mlp_bias"):
        raise UnsupportedModel(f"{source}: mlp_bias=true is not supported; allowed: false")
    required = ("num_attention_heads", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    missing = [k for k in required if k not in c]
    if missing:
        raise UnsupportedModel(f"{source}: missing key{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(repr(k) for k in missing)}")
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    return ModelArch(
        arch=model_type, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        qkv_bias=model_type == "qwen2",
        eos_token_id=eos[0] if isinstance(eos, list) else eos)


def transformer_config(arch: ModelArch, dtype: str = "float32"):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core import parallel_state
    params_dtype = torch_dtype(dtype)
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        add_qkv_bias=arch.qkv_bias, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Fused kernels are CUDA-only or absent on CPU; the unfused paths are exact.
        bias_activation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        sequence_parallel=False,
        # Micro-batches differ in length (packed responses): pipeline p2p sends shapes first.
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",   # (dense model: only a config check)
        # The GRPO loss is already normalised by the batch's token count: the schedule must not
        # divide it again by tokens or micro-batches.
        calculate_per_token_loss=True,
        # no CUDA graphs; [] is what megatron-core 0.16 turns its own default "full" into, after
        # warning on every config that "full" is deprecated
        cuda_graph_scope=[])


def stage_layers(arch: ModelArch) -> range:
    """The global indices of the decoder layers this pipeline stage holds (equal split)."""
    from megatron.core import parallel_state as ps
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size {pp} does not divide num_layers {arch.num_layers}")
    per = arch.num_layers // pp
    return range(rank * per, (rank + 1) * per)


CORE_ATTENTIONS = ("sdpa", "local", "shared_prompt")


def build_gpt_model(arch: ModelArch, dtype: str = "float32", core_attention: str = "sdpa",
                    attention_impl: str = "sdpa", fast_layers: bool = True):
    """A Megatron-core GPTModel on the current TP/PP groups (parallel state must be initialised):
    this pipeline stage's layers (`stage_layers`), the embedding on the first stage, the final norm
    and output layer on the last. A middle or last stage takes its input via set_input_tensor.
    Forward (last stage): (input_ids [B, S], position_ids [B, S], attention_mask [B|1, 1, S, S] bool,
    True = masked out, or None = causal) -> logits [B, S, V/TP] (vocab-sharded).

    core_attention:
    - "sdpa" (default): torch SDPA core attention (kernels/shared_prompt/megatron.py: the causal
      mask runs as is_causal, GQA without repeating K/V) in the training layer spec
      (`fast_layer_spec`: RoPE with its cos / sin computed once per forward, SwiGLU without the
      chunk / cat copies, RMSNorm with a hand-written backward). Exact: equal to "local" to fp32
      rounding (tests/test_models.py). RoPE over 0..S-1 (position_ids unused).
    - "local": Megatron's local spec as is (DotProductAttention, unfused RoPE and GLU): the
      reference the fast spec is tested against.
    - "shared_prompt": the fast spec with kernels/shared_prompt's core attention (`attention_impl`:
      the backend's attention_impl name) in `PositionRopeGPTModel`, whose RoPE follows
      position_ids; its attention_mask may also be a `SharedPromptLayout` (docs/shared-prompt.md).
    fast_layers=False keeps Megatron's own RoPE / GLU / norm modules with the "sdpa" or
    "shared_prompt" core attention (on Ascend MindSpeed patches those with its fused kernels)."""
    check_megatron_core()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention '{core_attention}' is unknown; allowed: {', '.join(CORE_ATTENTIONS)}")
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model_cls = GPTModel
    if core_attention == "shared_prompt":
        layer_spec = shared_prompt_layer_spec(layer_spec, attention_impl)
        model_cls = _position_rope_gpt_model_cls()
    elif core_attention == "sdpa":
        import copy
        from kernels.shared_prompt.megatron import SDPACoreAttention
        layer_spec = copy.deepcopy(layer_spec)
        layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    config = transformer_config(arch, dtype)
    if core_attention != "local" and fast_layers:
        layer_spec = fast_block_spec(config, fast_layer_spec(layer_spec))
    with _quiet_unknown_mlp():
        return model_cls(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
            position_embedding_type="rope", rotary_base=int(arch.rope_theta),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())


class _DropUnknownMLP:
    """logging filter: TransformerLayer warns "Unknown MLP type" for any MLP class but MLP itself
    (it then passes no tp_group, and MLP takes the default TP group: the same one)."""

    def filter(self, record) -> bool:
        return not str(record.getMessage()).startswith("Unknown MLP type")


@contextlib.contextmanager
def _quiet_unknown_mlp():
    import logging
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    f = _DropUnknownMLP()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def fast_layer_spec(layer_spec):
    """A copy of the local `layer_spec` (core attention left as it is) with the training fast
    paths: `RopeSelfAttention` (RoPE from cos / sin tables computed once per forward,
    `RotaryFunction`), `SwiGLUMLP` (`SwiGLUFunction`), `RMSNorm` (`RMSNormFunction`) for both
    layer norms (kernels/fast_layers). Parameter names and shapes are the local spec's, so checkpoints, conversion and
    TP sharding are unchanged."""
    import copy
    from kernels.fast_layers.megatron import RMSNorm, RopeSelfAttention, SwiGLUMLP
    layer_spec = copy.deepcopy(layer_spec)
    sub = layer_spec.submodules
    sub.self_attention.module = RopeSelfAttention
    sub.mlp.module = SwiGLUMLP
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
    return layer_spec


def fast_block_spec(config, layer_spec):
    """The TransformerBlock spec of this pipeline stage's layers with the final norm `RMSNorm`
    (Megatron builds the block of a bare layer spec the same way, with its own norm class)."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from kernels.fast_layers.megatron import RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=RMSNorm)


def shared_prompt_layer_spec(layer_spec, attention_impl: str):
    """A copy of `layer_spec` whose core attention is SharedPromptCoreAttention(attention_impl)."""
    import copy
    from megatron.core.transformer.spec_utils import ModuleSpec
    from kernels.shared_prompt import IMPLS
    from kernels.shared_prompt.megatron import SharedPromptCoreAttention
    if attention_impl not in IMPLS:
        raise ValueError(f"attention_impl '{attention_impl}' is unknown; allowed: {', '.join(IMPLS)}")
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SharedPromptCoreAttention, params={"attention_impl": attention_impl})
    return layer_spec


_POSITION_ROPE_CLS = None


def _position_rope_gpt_model_cls():
    """GPTModel whose rotary embedding is indexed by position_ids.

    Megatron's GPTModel applies RoPE for positions 0..S-1 of the row whatever position_ids say
    (they only feed learned absolute embeddings). Shared-prompt packing restarts the positions of
    every response at P, so here the RoPE table (S rows) is gathered per token: [S, B, 1, dim].
    Position ids must be < S (true for both packers). With position_ids = arange(S) the values are
    exactly Megatron's."""
    global _POSITION_ROPE_CLS
    if _POSITION_ROPE_CLS is None:
        from megatron.core.models.gpt import GPTModel

        class PositionRopeGPTModel(GPTModel):
            def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                            packed_seq_params=None, padding_mask=None):
                out = super()._preprocess(input_ids=input_ids, position_ids=position_ids,
                                          decoder_input=decoder_input, inference_context=inference_context,
                                          packed_seq_params=packed_seq_params, padding_mask=padding_mask)
                rope = out[1]
                if rope is None or position_ids is None or inference_context is not None:
                    return out
                if packed_seq_params is not None:
                    raise ValueError("PositionRopeGPTModel does not take packed_seq_params")
                table = rope[:, 0, 0]                                   # [S, dim]
                per_token = table[position_ids.t()].unsqueeze(2)        # [S, B, 1, dim]
                return (out[0], per_token) + tuple(out[2:])

        _POSITION_ROPE_CLS = PositionRopeGPTModel
    return _POSITION_ROPE_CLS
