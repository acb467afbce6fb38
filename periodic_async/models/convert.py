"""Hugging Face <-> Megatron-core weight conversion, tensor-parallel aware.

Layouts (H = hidden, d = head_dim, G = query groups = kv heads, q = heads per group):
- HF q_proj [G*q*d, H], k_proj / v_proj [G*d, H]  ->  Megatron linear_qkv [G*(q+2)*d, H], grouped
  per query group as [q heads | k | v]; TP shards whole groups (dim 0).
- HF gate_proj / up_proj [F, H]  ->  linear_fc1 [2F, H]; each TP rank holds [gate_r ; up_r].
- o_proj / down_proj: row-parallel (dim 1). Embedding and output layer: vocab-parallel (dim 0).
- Norms are replicated.

`load_hf_checkpoint` reads safetensors lazily and gives each rank only its shard;
`export_hf_weights` gathers TP and PP shards in buckets of bounded size (one flattened collective per
bucket) and yields (hf_name, tensor) in HF layout (the weight sync streams these to the rollout
workers; `save_hf_checkpoint` writes a directory). With PP, stage s holds layers
[s*L/PP, (s+1)*L/PP), numbered locally from 0 in its state dict.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterator

import torch

from .mcore import CheckpointError, ModelArch

TensorGetter = Callable[[str], torch.Tensor]


# ---------------------------------------------------------------------- full-tensor layout maps

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """[G*q*d, ...], [G*d, ...], [G*d, ...] -> [G*(q+2)*d, ...] (weights or biases)."""
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, -1, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    qd = arch.num_heads // g * d
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


def hf_to_mcore_shards(get: TensorGetter, arch: ModelArch, tp_rank: int, tp_size: int,
                       layers: range | None = None, pre_process: bool = True,
                       post_process: bool = True) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron-core state dict (decoder layers numbered locally from 0)."""
    out: dict[str, torch.Tensor] = {}
    layers = layers if layers is not None else range(arch.num_layers)
    if pre_process:
        out["embedding.word_embeddings.weight"] = _shard(get("model.embed_tokens.weight"), 0, tp_rank, tp_size)
    for local, i in enumerate(layers):
        h, m = _hf_layer(i), _mc_layer(local)
        for mc, (hf, dim) in _SIMPLE_LAYER.items():
            out[m + mc] = _shard(get(h + hf), dim, tp_rank, tp_size)
        att = h + "self_attn."
        qkv = fuse_qkv(get(att + "q_proj.weight"), get(att + "k_proj.weight"), get(att + "v_proj.weight"), arch)
        out[m + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, tp_rank, tp_size)
        if arch.qkv_bias:
            qkv_b = fuse_qkv(get(att + "q_proj.bias"), get(att + "k_proj.bias"), get(att + "v_proj.bias"), arch)
            out[m + "self_attention.linear_qkv.bias"] = _shard(qkv_b, 0, tp_rank, tp_size)
        gate = _shard(get(h + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(get(h + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if post_process:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = _shard(get("lm_head.weight"), 0, tp_rank, tp_size)
    return out


def mcore_to_hf_full(gather: TensorGetter, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from a getter of GATHERED (full, TP-unsharded) Megatron tensors. `linear_fc1` must
    be gathered per-rank-halves already regrouped as [gate ; up] (see export_hf_weights)."""
    yield "model.embed_tokens.weight", gather("embedding.word_embeddings.weight")
    for i in range(arch.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)
        for mc, (hf, _) in _SIMPLE_LAYER.items():
            yield h + hf, gather(m + mc)
        q, k, v = split_qkv(gather(m + "self_attention.linear_qkv.weight"), arch)
        yield h + "self_attn.q_proj.weight", q
        yield h + "self_attn.k_proj.weight", k
        yield h + "self_attn.v_proj.weight", v
        if arch.qkv_bias:
            qb, kb, vb = split_qkv(gather(m + "self_attention.linear_qkv.bias"), arch)
            yield h + "self_attn.q_proj.bias", qb
            yield h + "self_attn.k_proj.bias", kb
            yield h + "self_attn.v_proj.bias", vb
        gate, up = gather(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        yield h + "mlp.gate_proj.weight", gate
        yield h + "mlp.up_proj.weight", up
    yield "model.norm.weight", gather("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", gather("output_layer.weight")


# ---------------------------------------------------------------------- checkpoint I/O

class SafetensorsReader:
    """Lazy reader over a HF directory's safetensors files (single file or sharded with an index).
    A missing, truncated or unreadable file raises CheckpointError naming it."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            weight_map = _read_weight_map(index)
        elif os.path.exists(single):
            weight_map = None
        else:
            raise CheckpointError(f"model.path: {path} has no model.safetensors or model.safetensors.index.json "
                                  "(only safetensors checkpoints are supported)")
        self._path = path
        self._handles: dict[str, object] = {}
        if weight_map is None:
            h = self._open("model.safetensors")
            weight_map = {k: "model.safetensors" for k in h.keys()}
        self._weight_map = weight_map
        self.used: set[str] = set()

    def _open(self, fn: str):
        """The file's handle, opened once; safe_open reads and checks only the header (it refuses a
        file shorter than the header says, i.e. truncated), the tensors are mapped lazily."""
        if fn not in self._handles:
            from safetensors import SafetensorError, safe_open
            file = os.path.join(self._path, fn)
            if not os.path.exists(file):
                raise CheckpointError(f"{file}: file not found (listed in model.safetensors.index.json)")
            try:
                self._handles[fn] = safe_open(file, framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: not a readable safetensors file ({e}); "
                                      "re-download or re-save the checkpoint") from None
        return self._handles[fn]

    def check(self) -> None:
        """Open every file of the checkpoint, so that a missing or truncated shard is found before
        any model is built rather than halfway through loading it."""
        for fn in sorted(set(self._weight_map.values())):
            self._open(fn)

    def names(self) -> set[str]:
        return set(self._weight_map)

    def __call__(self, name: str) -> torch.Tensor:
        self.used.add(name)
        fn = self._weight_map.get(name)
        if fn is None:
            raise KeyError(f"{self._path}: checkpoint has no tensor '{name}'")
        from safetensors import SafetensorError
        try:
            return self._open(fn).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{os.path.join(self._path, fn)}: tensor '{name}' cannot be read ({e})") from None


def _read_weight_map(index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{index}: no 'weight_map' object (expected a safetensors index)") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, expected an object")
    return weight_map


def check_checkpoint(path: str) -> None:
    """CheckpointError naming the file if the directory's safetensors files are missing, truncated
    or unreadable; cheap (headers only)."""
    SafetensorsReader(path).check()


def load_hf_checkpoint(model: torch.nn.Module, arch: ModelArch, path: str) -> None:
    """Copy a HF checkpoint into this rank's Megatron-core model: its TP shard of its pipeline
    stage's layers (plus the embedding on the first stage, final norm / output on the last)."""
    from megatron.core import parallel_state as ps
    from .mcore import stage_layers
    reader = SafetensorsReader(path)
    layers = stage_layers(arch)
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    shards = hf_to_mcore_shards(reader, arch, tp_rank, tp_size, layers, pre, post)
    if post and not pre and arch.tie_word_embeddings:
        # tied embeddings with PP > 1: the last stage holds its own copy of the embedding as the
        # output layer (Megatron keeps the two in sync by all-reducing their gradients)
        shards["output_layer.weight"] = _shard(reader("model.embed_tokens.weight"), 0, tp_rank, tp_size)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(shards))
    if missing:
        raise KeyError(f"conversion produced no tensor for Megatron parameters {missing[:5]}")

    def other_stage(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) not in layers
        if name.startswith("model.embed_tokens."):
            return not pre
        return not post   # model.norm, lm_head
    # Every checkpoint tensor must land somewhere: a silently dropped one (a bias the Megatron
    # layout has no place for) would give a wrong model without any error.
    unused = sorted(n for n in reader.names() - reader.used
                    if not n.endswith("rotary_emb.inv_freq") and not other_stage(n)
                    and not (arch.tie_word_embeddings and n == "lm_head.weight"))
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
    if size == 1 or _tp_shard_dim(name) is None:
        return local.detach()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return _unshard(name, parts)


def mcore_full_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The full (TP-unsharded) shape of a Megatron parameter, from the architecture alone, so
    every rank can plan an export without seeing the other stages' parameters."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    for suffix, shape in (("word_embeddings.weight", (arch.vocab_size, h)), ("output_layer.weight", (arch.vocab_size, h)),
                          ("layernorm.weight", (h,)), ("linear_qkv.weight", (qkv, h)), ("linear_qkv.bias", (qkv,)),
                          ("linear_proj.weight", (h, arch.num_heads * d)), ("linear_fc1.weight", (2 * f, h)),
                          ("linear_fc2.weight", (h, f))):
        if name.endswith(suffix):
            return shape
    raise KeyError(f"unknown Megatron parameter {name}")


def _shape_only_export(arch: ModelArch) -> tuple[list[str], list[tuple[str, tuple[int, ...]]]]:
    """Run `mcore_to_hf_full` on shape-only meta tensors: (the Megatron names in the order it asks
    for them, the HF (name, shape) pairs it yields). No data is touched."""
    order: list[str] = []

    def record(name: str) -> torch.Tensor:
        order.append(name)
        return torch.empty(mcore_full_shape(name, arch), device="meta")
    layout = [(n, tuple(t.shape)) for n, t in mcore_to_hf_full(record, arch)]
    return order, layout


def export_order(arch: ModelArch) -> list[str]:
    """Global Megatron parameter names in the order `mcore_to_hf_full` asks for them."""
    return _shape_only_export(arch)[0]


def hf_layout(arch: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs `export_hf_weights` yields, without exporting anything."""
    return _shape_only_export(arch)[1]


def owner_stage(name: str, arch: ModelArch, pp: int) -> tuple[int, str]:
    """(pipeline stage holding a global Megatron parameter, its name on that stage)."""
    if name.startswith("embedding."):
        return 0, name
    if name.startswith("decoder.layers."):
        i = int(name.split(".")[2])
        per = arch.num_layers // pp
        stage = i // per
        return stage, _mc_layer(i - stage * per) + name.split(".", 3)[3]
    return pp - 1, name


class _BucketedGather:
    """Serves full Megatron tensors in export order, fetching them a bucket at a time: the owner
    stage's TP ranks all-gather the bucket's shards in ONE collective (flattened), then the owner
    broadcasts the full bucket over the pipeline group (one more). Every rank of the job must ask
    for the same names in the same order. Each tensor is handed out once and then forgotten, so
    at most about one bucket of gathered tensors is alive here."""

    def __init__(self, params: dict[str, torch.Tensor], arch: ModelArch, bucket_bytes: int):
        from megatron.core import parallel_state as ps
        self.params, self.arch = params, arch
        self.tp, self.pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dtype = next(iter(params.values())).dtype
        self.device = next(iter(params.values())).device
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        # buckets: consecutive names of one owner stage, at most bucket_bytes (a bigger tensor alone)
        self.buckets: list[tuple[int, list[str]]] = []
        size = 0
        for name in export_order(arch):
            stage, _ = owner_stage(name, arch, self.pp)
            nbytes = math.prod(mcore_full_shape(name, arch)) * itemsize
            if not self.buckets or self.buckets[-1][0] != stage or size + nbytes > bucket_bytes:
                self.buckets.append((stage, []))
                size = 0
            self.buckets[-1][1].append(name)
            size += nbytes
        self.next_bucket = 0
        self.ready: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.ready:
            if self.next_bucket >= len(self.buckets) or self.buckets[self.next_bucket][1][0] != name:
                raise RuntimeError(f"export: tensor {name} asked for out of order")
            self._fetch(*self.buckets[self.next_bucket])
            self.next_bucket += 1
        return self.ready.pop(name)

    def _local_shape(self, name: str) -> tuple[int, ...]:
        shape = list(mcore_full_shape(name, self.arch))
        dim = _tp_shard_dim(name)
        if dim is not None:
            shape[dim] //= self.tp
        return tuple(shape)

    def _fetch(self, stage: int, names: list[str]) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        full_shapes = [mcore_full_shape(n, self.arch) for n in names]
        full: list[torch.Tensor] = []
        if stage == self.pp_rank:
            local = [self.params[owner_stage(n, self.arch, self.pp)[1]].detach() for n in names]
            if self.tp == 1:
                full = local
            else:
                flat = torch.cat([t.reshape(-1) for t in local])                      # [sum local numel]
                parts = [torch.empty_like(flat) for _ in range(self.tp)]
                dist.all_gather(parts, flat, group=ps.get_tensor_model_parallel_group())
                offset = 0
                for n, t in zip(names, local):
                    pieces = [p[offset:offset + t.numel()].view(t.shape) for p in parts]
                    offset += t.numel()
                    full.append(_unshard(n, pieces))
        if self.pp > 1:
            numel = sum(math.prod(s) for s in full_shapes)
            flat = torch.cat([t.reshape(-1) for t in full]) if full else \
                torch.empty(numel, dtype=self.dtype, device=self.device)
            src = dist.get_global_rank(ps.get_pipeline_model_parallel_group(), stage)
            dist.broadcast(flat, src=src, group=ps.get_pipeline_model_parallel_group())
            full, offset = [], 0
            for s in full_shapes:
                full.append(flat[offset:offset + math.prod(s)].view(s))
                offset += math.prod(s)
        for n, t, s in zip(names, full, full_shapes):
            if tuple(t.shape) != tuple(s):
                raise RuntimeError(f"export: {n} has shape {tuple(t.shape)}, expected {tuple(s)}")
            self.ready[n] = t


def _unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Full tensor from the TP ranks' shards (in rank order)."""
    dim = _tp_shard_dim(name)
    if dim is None:
        return pieces[0]
    if name.endswith("linear_fc1.weight"):
        # each rank holds [gate_r ; up_r]: regroup to [gate ; up]
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=dim)


def export_hf_weights(model: torch.nn.Module, arch: ModelArch, bucket_bytes: int = 256 << 20,
                      select: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-layout (name, full tensor) pairs gathered over TP and PP in buckets of at most
    `bucket_bytes`. EVERY rank must iterate it to the end (collectives); all ranks receive every
    tensor. `select` picks what is exported per parameter (default the weight; `lambda p: p.grad`
    exports gradients in HF layout)."""
    params = {n: select(p) for n, p in model.named_parameters()}
    return mcore_to_hf_full(_BucketedGather(params, arch, int(bucket_bytes)), arch)


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
