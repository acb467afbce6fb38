"""Response- and prompt-length distributions for the replay's workloads: fixed, empirical (a run's
timeline), log-normal, Pareto, and the specs of tools/simulate.py's --lengths."""
from __future__ import annotations

import math
import random
import statistics

from .runs import read_timeline


class Lengths:
    """A response-length (or prompt-length) distribution: sample(rng, n) -> n ints >= 1."""
    spec = ""

    def sample(self, rng: random.Random, n: int) -> list[int]:
        raise NotImplementedError

    def mean(self, rng_seed: int = 0, n: int = 20000) -> float:
        return statistics.fmean(self.sample(random.Random(rng_seed), n))


class FixedLengths(Lengths):
    def __init__(self, value: int):
        self.value = int(value)
        self.spec = f"fixed:{self.value}"

    def sample(self, rng, n):
        return [self.value] * n


class EmpiricalLengths(Lengths):
    def __init__(self, values: list[int], label: str = "empirical"):
        if not values:
            raise ValueError("empirical lengths: no values")
        self.values = [int(v) for v in values]
        self.spec = f"{label} ({len(self.values)} values, mean {statistics.fmean(self.values):.2f})"

    def sample(self, rng, n):
        return [rng.choice(self.values) for _ in range(n)]


class LogNormalLengths(Lengths):
    def __init__(self, median: float, sigma: float, cap: int, floor: int = 1):
        self.median, self.sigma, self.cap, self.floor = median, sigma, int(cap), int(floor)
        self.spec = f"lognormal:median={median:g},sigma={sigma:g},cap={self.cap}"

    def sample(self, rng, n):
        mu = math.log(self.median)
        return [min(self.cap, max(self.floor, int(round(rng.lognormvariate(mu, self.sigma))))) for _ in range(n)]


class ParetoLengths(Lengths):
    """Long-tailed: xm * Pareto(alpha), capped."""

    def __init__(self, xm: float, alpha: float, cap: int):
        self.xm, self.alpha, self.cap = xm, alpha, int(cap)
        self.spec = f"pareto:xm={xm:g},alpha={alpha:g},cap={self.cap}"

    def sample(self, rng, n):
        return [min(self.cap, max(1, int(round(self.xm * rng.paretovariate(self.alpha))))) for _ in range(n)]


def parse_lengths(spec: str) -> Lengths:
    """fixed:N | lognormal:MEDIAN,SIGMA,CAP | pareto:XM,ALPHA,CAP | empirical:RUN_DIR[,RUN_DIR...]
    (the response lengths of the runs' timelines) | empirical-prompt:RUN_DIR (their prompt lengths)."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        return FixedLengths(int(arg))
    if kind == "lognormal":
        m, s, cap = arg.split(",")
        return LogNormalLengths(float(m), float(s), int(cap))
    if kind == "pareto":
        xm, a, cap = arg.split(",")
        return ParetoLengths(float(xm), float(a), int(cap))
    if kind in ("empirical", "empirical-prompt"):
        key = "response_tokens" if kind == "empirical" else "prompt_tokens"
        values = []
        for d in arg.split(","):
            values += [e[key] for e in read_timeline(d) if e["kind"] == "generate" and key in e]
        return EmpiricalLengths(values, label=f"{kind}:{arg}")
    raise ValueError(f"lengths '{spec}': expected fixed:N, lognormal:MEDIAN,SIGMA,CAP, pareto:XM,ALPHA,CAP "
                     "or empirical:RUN_DIR")
