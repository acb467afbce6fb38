"""The rollout-engine interface (hf_engine.py, vllm_engine.py) and the request / result types.

A request is one prompt with its own group size K (`n`), sampling parameters and seed; results
come back one response at a time, as they finish, tagged with the policy version that made them.
Sampling is reproducible per (seed, sample index): the same request gives the same responses
whatever else is batched with it, which is what lets `periodic` be compared with `sync` exactly.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:   # the types are torch-free, so the scheduling side can use them without torch
    import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 = off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    # True: the engine does not stop on the tokenizer's EOS (nor add it to the stops): every
    # response runs to max_new_tokens unless it hits one of stop_token_ids (benchmarks)
    ignore_eos: bool = False


def with_budget(sampling: SamplingParams, max_new_tokens: int | None) -> SamplingParams:
    """`sampling` with a prompt's own generation budget (data.max_new_tokens_key), or as it is."""
    return sampling if max_new_tokens is None else replace(sampling, max_new_tokens=max_new_tokens)


@dataclass
class RolloutRequest:
    group_index: int              # which prompt of the batch
    prompt_ids: list[int]
    n: int                        # K, the group size of THIS prompt
    sampling: SamplingParams
    seed: int
    # Which samples k to generate (None = all of range(n)): a re-dispatch after a worker failure
    # asks only for the missing ones, and later a pilot-commit allocator sends more in two phases.
    sample_indices: list[int] | None = None

    def samples(self) -> list[int]:
        """The sample indices k this request asks for."""
        return list(self.sample_indices) if self.sample_indices is not None else list(range(self.n))


@dataclass
class RolloutResult:
    group_index: int
    sample_index: int             # k in [0, n)
    prompt_ids: list[int]
    response_ids: list[int]       # includes the stop token when one was produced
    logprobs: list[float]         # log pi(token) under the sampling temperature, one per response token
    finish_reason: str            # "stop" | "length"
    # the version of the weights that produced the response's FIRST token (its oldest: the one
    # the staleness rule judges); every token's own version is in token_versions
    policy_version: int
    timings: dict = field(default_factory=dict)
    # the version that produced each response token, when a weight update interrupted the
    # response (`RolloutEngine.interruptible`); None: every token is policy_version's
    token_versions: list[int] | None = None

    def versions(self) -> list[int]:
        """The version that produced each response token."""
        return list(self.token_versions) if self.token_versions is not None else [self.policy_version] * len(self.response_ids)


def sample_seed(request_seed: int, sample_index: int) -> int:
    """A stable 63-bit seed for sample k of a request (no Python hash randomisation)."""
    return (request_seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 1) % (2 ** 63)


class RolloutEngine(abc.ABC):
    """Generates responses with the current policy weights, continuously batched.

    serve(poll, initial, on_slots) is the worker's loop: it yields the list of results finished at
    each engine step; between steps it calls poll() for newly arrived requests ([] for none, None
    once no more will come) and reports the number of sequences in flight with on_slots(n); it
    ends when nothing is pending or running and poll() returned None. generate(requests) is the
    same for a fixed set of requests (the colocated `sync` mode). update_weights(named_tensors,
    version) loads HF-layout tensors (streamed, one at a time) and tags later tokens with
    `version`. An engine with `interruptible = True` accepts it from inside `poll()` with requests
    in flight: the in-flight sequences continue under the new weights (their KV cache recomputed)
    and their results carry per-token versions; any other engine is only updated with nothing in
    flight (the rollout worker drains it first)."""

    policy_version: int = 0
    interruptible: bool = False

    @abc.abstractmethod
    def serve(self, poll: Callable[[], list[RolloutRequest] | None], initial: Iterable[RolloutRequest] = (),
              on_slots: Callable[[int], None] | None = None) -> Iterator[list[RolloutResult]]: ...

    def generate(self, requests: list[RolloutRequest]) -> Iterator[RolloutResult]:
        for finished in self.serve(lambda: None, initial=requests):
            yield from finished

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int) -> None: ...

    def close(self) -> None:
        pass
