"""Sizes of a model's parts, torch-free: bytes per `model.dtype` name and the parameters one device
holds under Megatron-core's (training) or vLLM's (rollout) tensor-parallel sharding. The memory
plan (memory_plan.py) prices them; tests/test_memory_plan.py checks `stage_param_numel` against a
built Megatron-core model."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .mcore import ModelArch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}   # per element, by model.dtype name


def _layer_numel(arch: "ModelArch", qkv_rows: int, q_cols: int, ffn_cols: int) -> int:
    """One transformer layer's linear weights on one device: the fused q/k/v projection (qkv_rows
    output rows, + their bias for qwen2), the output projection (q_cols input columns) and the
    SwiGLU MLP (fc1's gate and up, fc2; ffn_cols wide). Norms are counted by the callers."""
    h = arch.hidden_size
    return (qkv_rows * h + (qkv_rows if arch.qkv_bias else 0)   # linear_qkv
            + h * q_cols                                       # linear_proj
            + 2 * ffn_cols * h                                 # linear_fc1 (gate, up)
            + h * ffn_cols)                                    # linear_fc2


def stage_param_numel(arch: "ModelArch", tp: int = 1, pp: int = 1, stage: int = 0) -> tuple[int, int]:
    """(parameters, of which RMSNorm weights) on one rank of pipeline stage `stage`, as Megatron-core
    shards them: q/k/v (+ bias), fc1 (gate + up) and the vocabulary split by TP over their output
    rows, linear_proj and fc2 over their input columns; norms replicated over TP. Layers split
    equally over PP; the embedding on the first stage, the final norm and output layer on the last
    (tied embeddings: no output layer with PP=1; with PP>1 the last stage holds its own copy)."""
    h, qd, kvd = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    layer = _layer_numel(arch, (qd + 2 * kvd) // tp, qd // tp, arch.ffn_hidden_size // tp)
    layers = arch.num_layers // pp
    first, last = stage == 0, stage == pp - 1
    vocab_shard = (arch.vocab_size // tp) * h
    norms = layers * 2 * h + (h if last else 0)
    numel = layers * layer + norms
    if first:
        numel += vocab_shard
    if last and not (arch.tie_word_embeddings and first):
        numel += vocab_shard
    return numel, norms


def vllm_shard_numel(arch: "ModelArch", tp: int = 1) -> tuple[int, int]:
    """(parameters, key/value width) on one device of a vLLM engine with tensor parallel size `tp`:
    attention heads, the MLP and the vocabulary split over TP, norms replicated, and key/value heads
    split too, or replicated when there are fewer than TP (vLLM's QKVParallelLinear: at least one
    per device). tp == 1: the whole model (`stage_param_numel`)."""
    h, qd = arch.hidden_size, arch.num_heads * arch.head_dim
    kvd = max(1, arch.num_kv_heads // tp) * arch.head_dim
    layer = _layer_numel(arch, qd // tp + 2 * kvd, qd // tp, arch.ffn_hidden_size // tp)
    vocab = math.ceil(arch.vocab_size / tp) * h
    norms = arch.num_layers * 2 * h + h
    return arch.num_layers * layer + norms + vocab * (1 if arch.tie_word_embeddings else 2), kvd
