"""Hugging Face <-> Megatron-core weight conversion, tensor-parallel aware.

Layouts (H = hidden, d = head_dim, G = query groups = kv heads, q = heads per group):
- HF q_proj [G*q*d, H], k_proj / v_proj [G*d, H]  ->  Megatron linear_qkv [G*(q+2)*d, H], grouped
  per query group as [q heads | k | v]; TP shards whole groups (dim 0).
- HF gate_proj / up_proj [F, H]  ->  linear_fc1 [2F, H]; each TP rank holds [gate_r ; up_r].
- o_proj / down_proj: row-parallel (dim 1). Embedding and output layer: vocab-parallel (dim 0).
- Norms are replicated.

`load_hf_checkpoint` reads safetensors lazily and gives each rank only its shard;
`export_hf_weights` gathers shards and yields (hf_name, tensor) in HF layout, one tensor at a time
(the weight sync streams these to the rollout workers; `save_hf_checkpoint` writes a directory).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch

from .mcore import ModelSpec

TensorGetter = Callable[[str], torch.Tensor]


# ---------------------------------------------------------------------- full-tensor layout maps

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[G*q*d, ...], [G*d, ...], [G*d, ...] -> [G*(q+2)*d, ...] (weights or biases)."""
    g, d = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, -1, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.num_kv_heads, spec.head_dim
    qd = spec.num_heads // g * d
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, qd + 2 * d, *rest)
    q, k, v = grouped.split([qd, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}."


# Replicated or simply-sharded tensors: mcore suffix -> (hf suffix, TP shard dim or None).
_SIMPLE_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}


def _shard(t: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    if dim is None or size == 1:
        return t
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by TP={size}")
    return t.chunk(size, dim=dim)[rank]


def hf_to_mcore_shards(get: TensorGetter, spec: ModelSpec, tp_rank: int, tp_size: int,
                       layers: range | None = None, pre_process: bool = True,
                       post_process: bool = True) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron-core state dict (decoder layers numbered locally from 0)."""
    out: dict[str, torch.Tensor] = {}
    layers = layers if layers is not None else range(spec.num_layers)
    if pre_process:
        out["embedding.word_embeddings.weight"] = _shard(get("model.embed_tokens.weight"), 0, tp_rank, tp_size)
    for local, i in enumerate(layers):
        h, m = _hf_layer(i), _mc_layer(local)
        for mc, (hf, dim) in _SIMPLE_LAYER.items():
            out[m + mc] = _shard(get(h + hf), dim, tp_rank, tp_size)
        att = h + "self_attn."
        qkv = fuse_qkv(get(att + "q_proj.weight"), get(att + "k_proj.weight"), get(att + "v_proj.weight"), spec)
        out[m + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, tp_rank, tp_size)
        if spec.qkv_bias:
            qkv_b = fuse_qkv(get(att + "q_proj.bias"), get(att + "k_proj.bias"), get(att + "v_proj.bias"), spec)
            out[m + "self_attention.linear_qkv.bias"] = _shard(qkv_b, 0, tp_rank, tp_size)
        gate = _shard(get(h + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(get(h + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if post_process:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        if not spec.tie_word_embeddings:
            out["output_layer.weight"] = _shard(get("lm_head.weight"), 0, tp_rank, tp_size)
    return out


def mcore_to_hf_full(gather: TensorGetter, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from a getter of GATHERED (full, TP-unsharded) Megatron tensors. `linear_fc1` must
    be gathered per-rank-halves already regrouped as [gate ; up] (see export_hf_weights)."""
    yield "model.embed_tokens.weight", gather("embedding.word_embeddings.weight")
    for i in range(spec.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)
        for mc, (hf, _) in _SIMPLE_LAYER.items():
            yield h + hf, gather(m + mc)
        q, k, v = split_qkv(gather(m + "self_attention.linear_qkv.weight"), spec)
        yield h + "self_attn.q_proj.weight", q
        yield h + "self_attn.k_proj.weight", k
        yield h + "self_attn.v_proj.weight", v
        if spec.qkv_bias:
            qb, kb, vb = split_qkv(gather(m + "self_attention.linear_qkv.bias"), spec)
            yield h + "self_attn.q_proj.bias", qb
            yield h + "self_attn.k_proj.bias", kb
            yield h + "self_attn.v_proj.bias", vb
        gate, up = gather(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        yield h + "mlp.gate_proj.weight", gate
        yield h + "mlp.up_proj.weight", up
    yield "model.norm.weight", gather("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", gather("output_layer.weight")


# ---------------------------------------------------------------------- checkpoint I/O

class SafetensorsReader:
    """Lazy reader over a HF directory's safetensors files (single file or sharded with an index)."""

    def __init__(self, path: str):
        from safetensors import safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            weight_map = None
        else:
            raise FileNotFoundError(f"model.path: {path} has no model.safetensors or model.safetensors.index.json "
                                    "(only safetensors checkpoints are supported)")
        self._path = path
        self._handles: dict[str, object] = {}
        self._open = lambda fn: safe_open(os.path.join(path, fn), framework="pt")
        if weight_map is None:
            h = self._open("model.safetensors")
            self._handles["model.safetensors"] = h
            weight_map = {k: "model.safetensors" for k in h.keys()}
        self._weight_map = weight_map
        self.used: set[str] = set()

    def names(self) -> set[str]:
        return set(self._weight_map)

    def __call__(self, name: str) -> torch.Tensor:
        self.used.add(name)
        fn = self._weight_map.get(name)
        if fn is None:
            raise KeyError(f"{self._path}: checkpoint has no tensor '{name}'")
        if fn not in self._handles:
            self._handles[fn] = self._open(fn)
        return self._handles[fn].get_tensor(name)


def load_hf_checkpoint(model: torch.nn.Module, spec: ModelSpec, path: str) -> None:
    """Copy a HF checkpoint into this rank's Megatron-core model (TP shard only)."""
    from megatron.core import parallel_state as ps
    reader = SafetensorsReader(path)
    shards = hf_to_mcore_shards(reader, spec, ps.get_tensor_model_parallel_rank(),
                                ps.get_tensor_model_parallel_world_size())
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(shards))
    if missing:
        raise KeyError(f"conversion produced no tensor for Megatron parameters {missing[:5]}")
    # Every checkpoint tensor must land somewhere: a silently dropped one (a bias the Megatron
    # layout has no place for) would give a wrong model without any error.
    unused = sorted(n for n in reader.names() - reader.used
                    if not n.endswith("rotary_emb.inv_freq") and not (spec.tie_word_embeddings and n == "lm_head.weight"))
    if unused:
        raise KeyError(f"{path}: checkpoint tensors with no place in the Megatron model: {unused[:5]}")
    with torch.no_grad():
        for name, t in shards.items():
            p = params[name]
            if p.shape != t.shape:
                raise ValueError(f"{name}: checkpoint shard {tuple(t.shape)} != model {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def _tp_shard_dim(name: str) -> int | None:
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                      "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def gather_tp(name: str, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of a TP-sharded Megatron parameter (all-gather over the TP group)."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist
    size = ps.get_tensor_model_parallel_world_size()
    dim = _tp_shard_dim(name)
    if size == 1 or dim is None:
        return local.detach()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    if name.endswith("linear_fc1.weight"):
        # each rank holds [gate_r ; up_r]: regroup to [gate ; up]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def export_hf_weights(model: torch.nn.Module, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-layout (name, full tensor) pairs; every TP rank must iterate it (collectives)."""
    params = dict(model.named_parameters())
    return mcore_to_hf_full(lambda n: gather_tp(n, params[n]), spec)


def save_hf_checkpoint(named_tensors: Iterator[tuple[str, torch.Tensor]], src_dir: str, out_dir: str) -> None:
    """Write an HF directory: tensors as model.safetensors, config and tokenizer copied from src_dir."""
    import shutil
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {n: t.contiguous().clone() for n, t in named_tensors}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for fn in os.listdir(src_dir):
        if fn.endswith((".json", ".txt", ".model", ".tiktoken")) and not fn.startswith("model.safetensors"):
            shutil.copy(os.path.join(src_dir, fn), os.path.join(out_dir, fn))
