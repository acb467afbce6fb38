"""The pool's weights buffer: every tensor of the HF layout, back to back in one flat tensor
(shared memory on one node). The pool writes it (`write_buffer`), a worker reads it (`views`,
`engine_weights`); torch only, no process of its own."""
from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch

Layout = list[tuple[str, tuple[int, ...]]]


def views(buf: torch.Tensor, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view into the flat buffer) in layout order."""
    offset = 0
    for name, shape in layout:
        n = math.prod(shape)
        yield name, buf[offset:offset + n].view(shape)
        offset += n


def engine_weights(buf, layout: Layout):
    """What an engine loads from the pool's buffer: views of the tensor the worker was given, or,
    for a vLLM engine with tensor parallelism, the buffer's named handle (weight_sync.SharedWeights:
    picklable, so vLLM's TP processes open it themselves; iterating it gives the same views)."""
    return views(buf, layout) if isinstance(buf, torch.Tensor) else buf


def write_buffer(buf: torch.Tensor, layout: Layout, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy a full set of HF-layout tensors into the buffer (all names of the layout)."""
    expected = dict(layout)
    by_name = dict(views(buf, layout))
    seen = set()
    for name, t in named_tensors:
        if name not in by_name:
            raise KeyError(f"rollout weight sync: workers have no parameter '{name}'")
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"rollout weight sync: '{name}' has shape {tuple(t.shape)}, workers expect {expected[name]}")
        by_name[name].copy_(t)
        seen.add(name)
    if seen != set(by_name):
        raise KeyError(f"rollout weight sync: no tensor received for {sorted(set(by_name) - seen)[:5]}")
