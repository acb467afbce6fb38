"""Group size K per prompt, chosen when a batch is planned (torch-free).

Every group carries its own K (RolloutRequest.n, Group.size); nothing downstream assumes a
constant. A sizer is a `GroupSizer` registered by name (`rollout.group_sizing`, `GROUP_SIZERS`;
a new one is one `register_group_sizer("name")` away); the producer core calls it, in every mode:
`begin_step(step, prompt_keys)` when a batch is planned, `group_size(step, i)` per prompt,
`observe(step, lengths, prompt_keys)` when the batch's responses are all in (its metrics), and
`state_dict` / `load_state_dict` for checkpoints. Two are built in:

- `FixedGroupSize`: `rollout.n` for every prompt (`rollout.group_sizing: fixed`, the default).
- `StragglerAwareGroupSize` (`rollout.group_sizing: sagc`): one K per step, chosen from a few
  candidate sizes so that the step's generation rarely waits on a straggler.

Straggler-aware group control (SAGC). A larger group gives a better advantage baseline (utility
u(G) = log2 G) but more samples per prompt, so the step's longest response - which the step waits
for - grows with G. Step t is a straggler step, S_t = 1, when the longest of its responses is more
than `tau` times the median one. The controller holds the long-run share of straggler steps near
`delta` as a constrained bandit:

- per size G a Beta(alpha_G, beta_G) posterior on p(G) = P(S = 1 | G), discounted by `gamma`
  each step towards the Beta(1, 1) prior, so beliefs about an arm follow the policy's drifting
  lengths and an arm left alone returns to the prior (and is explored again) instead of keeping a
  stale verdict forever;
- Thompson sampling: p~_G ~ Beta(alpha_G, beta_G) for every G, then G_t = argmax of
  log2 G - lambda * p~_G over the current size and its neighbours in the sorted candidate list
  (one size up or down per step: K never jumps, so the batch's cost changes gradually);
- projected dual ascent on the constraint E[S] <= delta: lambda <- max(0, lambda + eta (S_t - delta)).
  Summing the update gives mean(S) - delta = (lambda_T - lambda_0) / (eta T) while the projection
  is inactive, so with lambda bounded the straggler rate converges to delta (or below it, when even
  the largest size straggles less often than delta).

Inputs are response lengths only (tokens). With `prompt_prior` the controller also keeps each
prompt's length history and uses it to predict the coming batch's straggler probability per G
(see `predict_straggler_probability`), added to the draw as pseudo-observations: the seed method
sees only past steps and cannot tell that this batch holds prompts known for long tails.

`state_dict()` is plain JSON (posteriors, lambda, current G, the RNG state, counters, the prompt
history): a run resumed from a checkpoint makes the same decisions as the uninterrupted one.
docs/group-sizing.md has the derivation of the defaults.
"""
from __future__ import annotations

import hashlib
import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

# rollout.sagc's checks live with the other config checks; re-exported here for SAGC's users
from ..config.validation import validate_sagc  # noqa: F401

PRIOR_ALPHA = 1.0       # Beta(1, 1): the uniform prior every posterior is discounted towards
PRIOR_BETA = 1.0
PROMPT_PRIOR_DRAWS = 64  # Monte Carlo batches per prediction of the prompt prior


class GroupSizer:
    """What the producer core calls (module docstring); a sizer that learns nothing keeps the
    defaults."""

    def begin_step(self, step: int, prompt_keys: Optional[Sequence[str]] = None) -> None:
        """The batch of `step` is being planned, with these prompts."""

    def group_size(self, step: int, group_index: int) -> int:
        raise NotImplementedError

    def observe(self, step: int, lengths: Sequence[Sequence[int]],
                prompt_keys: Optional[Sequence[str]] = None) -> dict[str, float]:
        """The batch's response lengths, per trained group: its metrics."""
        return {}

    def state_dict(self) -> Optional[dict]:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class FixedGroupSize(GroupSizer):
    n: int

    def group_size(self, step: int, group_index: int) -> int:
        return self.n


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A stable key of a prompt (its token ids): the same in every process and run, unlike hash()."""
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=8).hexdigest()


def straggler_ratio(lengths: Iterable[int]) -> float:
    """max / median of a step's response lengths (tokens); a zero-length median counts as 1."""
    flat = list(lengths)
    return max(flat) / max(statistics.median(flat), 1)


def group_straggler_share(groups: Sequence[Sequence[int]], tau: float) -> float:
    """The share of a step's groups whose own max / median response length exceeds tau (groups
    with a response; 0.0 when none): the per-group straggler statistic, in which a group of G
    samples straggles more often the larger G is, however many prompts the step has."""
    ratios = [straggler_ratio(g) for g in groups if len(g)]
    return sum(r > tau for r in ratios) / len(ratios) if ratios else 0.0


def straggler_event(groups: Sequence[Sequence[int]], tau: float, statistic: str) -> float:
    """S_t of a step from its response lengths per group: `step` 1 when the longest of all the
    step's responses is over tau x their median (0 otherwise); `group` the share of its groups
    that straggle on their own (group_straggler_share), a fraction in [0, 1] that the Beta
    posterior takes as a fractional observation and the dual update as it is."""
    if statistic == "step":
        flat = [int(n) for g in groups for n in g]
        return 1 if flat and straggler_ratio(flat) > tau else 0
    if statistic == "group":
        return group_straggler_share(groups, tau)
    raise ValueError(f"rollout.sagc.straggler_statistic: unknown '{statistic}'; allowed: step, group")


def choose_size(candidates: Sequence[int], current: int, draws: Sequence[float], lam: float) -> int:
    """argmax of log2 G - lam * draws[G's index] over `current` and its neighbours in the sorted
    `candidates`; a tie goes to the smaller G."""
    i = list(candidates).index(current)
    best, best_score = None, -math.inf
    for j in range(max(0, i - 1), min(len(candidates), i + 2)):
        score = math.log2(candidates[j]) - lam * draws[j]
        if score > best_score:
            best, best_score = candidates[j], score
    return best


GROUP_SIZERS: dict[str, Callable[..., GroupSizer]] = {}


def register_group_sizer(name: str):
    """Decorator: register `factory(rollout_cfg) -> GroupSizer` under `name` (rollout.group_sizing)."""
    def register(factory):
        if name in GROUP_SIZERS and GROUP_SIZERS[name] is not factory:
            raise ValueError(f"rollout.group_sizing: '{name}' is registered twice")
        GROUP_SIZERS[name] = factory
        return factory
    return register


def check_group_sizing(name: str) -> None:
    if name not in GROUP_SIZERS:
        from ..errors import ConfigError
        raise ConfigError(f"rollout.group_sizing: unknown sizer '{name}'; registered: {', '.join(sorted(GROUP_SIZERS))}")


def build_group_sizer(rollout_cfg) -> GroupSizer:
    """The sizer rollout.group_sizing names (fixed: rollout.n; sagc: starting at rollout.n)."""
    check_group_sizing(rollout_cfg.group_sizing)
    return GROUP_SIZERS[rollout_cfg.group_sizing](rollout_cfg)


def predict_straggler_probability(fits: Sequence[tuple[float, float]], candidates: Sequence[int], tau: float,
                                  length_cap: float, seed: int, step: int, statistic: str = "step") -> list[float]:
    """E[S | G] for a batch whose prompt i has log-lengths ~ Normal(mu_i, sd_i) (`fits`): over
    PROMPT_PRIOR_DRAWS simulated batches (each prompt G responses, lengths rounded and clipped to
    [1, length_cap], the longest seen), the share whose max / median exceeds tau (`step`), or the
    mean share of prompts whose own G responses do (`group`). One normal draw
    serves every G (common random numbers), so the estimate is monotone in G in the max; the
    generator is seeded by (seed, step): the prediction needs no state of its own."""
    import numpy as np
    mu = np.array([f[0] for f in fits])[None, :, None]          # (1, prompts, 1)
    sd = np.array([f[1] for f in fits])[None, :, None]
    z = np.random.default_rng([seed, step]).standard_normal((PROMPT_PRIOR_DRAWS, len(fits), max(candidates)))
    out = []
    for g in candidates:
        lengths = np.clip(np.rint(np.exp(mu + sd * z[:, :, :g])), 1, max(length_cap, 1))
        if statistic == "group":      # each prompt's g responses on their own: the mean share
            ratio = lengths.max(axis=2) / np.median(lengths, axis=2)            # (draws, prompts)
            out.append(float(np.mean(ratio > tau)))
            continue
        flat = lengths.reshape(PROMPT_PRIOR_DRAWS, -1)           # (draws, prompts * g)
        ratio = flat.max(axis=1) / np.median(flat, axis=1)
        out.append(float(np.mean(ratio > tau)))
    return out


class StragglerAwareGroupSize(GroupSizer):
    """SAGC (module docstring): one group size per step, from `cfg.candidates`, starting at
    `start_size`. Protocol, once per step: `begin_step(step, prompt_keys)` (or the first
    `group_size(step, i)`) decides G_t; `observe(step, lengths, prompt_keys)` once the step's
    responses are all in feeds their lengths back and returns its metrics. Decisions wait for
    their feedback by step: in the async mode step t + 1 may be decided before step t is
    observed (a bandit with delayed feedback: it decides from what it has seen so far)."""

    def __init__(self, cfg, start_size: int):
        self.cfg = cfg
        self.candidates = tuple(int(g) for g in cfg.candidates)
        if start_size not in self.candidates:
            raise ValueError(f"start size {start_size} is not one of the candidates {self.candidates}")
        self.size = start_size              # G of the step decided last (the "current" G)
        self.step: Optional[int] = None     # the step decided last
        self.lam = 0.0                      # dual variable of E[S] <= delta
        self.alpha = [PRIOR_ALPHA] * len(self.candidates)   # per candidate, in candidates' order
        self.beta = [PRIOR_BETA] * len(self.candidates)
        self.rng = random.Random(cfg.seed)
        self.steps_observed = 0
        self.straggler_steps = 0
        # prompt_prior: key -> [EMA of the mean log-length, EMA of the mean squared log-length]
        self.prompt_history: dict[str, list[float]] = {}
        self.length_cap = 0.0               # the longest response seen (the prediction's clip)
        # step -> (G played, the predicted P(S=1 | G) it was decided with, if any), until observed
        self.pending: dict[int, tuple[int, Optional[list[float]]]] = {}
        self._statistic = getattr(cfg, "straggler_statistic", "step")

    # ------------------------------------------------------------------ decide
    def begin_step(self, step: int, prompt_keys: Optional[Sequence[str]] = None) -> int:
        """Decide G for `step` (once: a repeated call returns the same G)."""
        if step in self.pending:
            return self.pending[step][0]
        q = self._predict(step, prompt_keys) if self.cfg.prompt_prior and prompt_keys else None
        w = self.cfg.prompt_prior_weight
        draws = []
        for j in range(len(self.candidates)):   # every arm, in order: the RNG stream does not depend on G
            a, b = self.alpha[j], self.beta[j]
            if q is not None:
                a, b = a + w * q[j], b + w * (1 - q[j])
            draws.append(self.rng.betavariate(a, b))
        self.size = choose_size(self.candidates, self.size, draws, self.lam)
        self.step = step
        self.pending[step] = (self.size, q)
        return self.size

    def group_size(self, step: int, group_index: int) -> int:
        return self.begin_step(step)

    def _predict(self, step: int, prompt_keys: Sequence[str]) -> Optional[list[float]]:
        """Predicted P(S = 1 | G) of the batch from its prompts' histories; a prompt never seen
        takes the mean fit of those seen. None when none was seen."""
        known = [self.prompt_history[k] for k in prompt_keys if k in self.prompt_history]
        if not known:
            return None
        default = [sum(h[0] for h in known) / len(known), sum(h[1] for h in known) / len(known)]
        fits = []
        for k in prompt_keys:
            mu, m2 = self.prompt_history.get(k, default)
            fits.append((mu, math.sqrt(max(m2 - mu * mu, 0.0))))
        return predict_straggler_probability(fits, self.candidates, self.cfg.tau, self.length_cap,
                                             self.cfg.seed, step, self._statistic)

    # ------------------------------------------------------------------ learn
    def observe(self, step: int, lengths: Sequence[Sequence[int]],
                prompt_keys: Optional[Sequence[str]] = None) -> dict[str, float]:
        """Feed back the step's response lengths (tokens; one list per group, `prompt_keys[i]`
        group i's prompt) and return the step's sagc/* metrics."""
        if step not in self.pending:
            raise ValueError(f"observe(step {step}): no decision awaits feedback for that step "
                             f"(awaiting: {sorted(self.pending)})")
        size, prior_q = self.pending.pop(step)
        cfg = self.cfg
        flat = [int(n) for group in lengths for n in group]
        ratio = straggler_ratio(flat)
        share = group_straggler_share(lengths, cfg.tau)
        s = straggler_event(lengths, cfg.tau, self._statistic)
        played = self.candidates.index(size)
        if cfg.forgetting == "seed":
            # the seed's rule: only the played arm, discounted towards Beta(0, 0) (alpha, beta stay > 0)
            self.alpha[played] *= cfg.gamma
            self.beta[played] *= cfg.gamma
        else:
            for j in range(len(self.candidates)):
                # discount every arm towards the prior: gamma * alpha + (1 - gamma) * alpha0
                self.alpha[j] = PRIOR_ALPHA + cfg.gamma * (self.alpha[j] - PRIOR_ALPHA)
                self.beta[j] = PRIOR_BETA + cfg.gamma * (self.beta[j] - PRIOR_BETA)
        self.alpha[played] += s
        self.beta[played] += 1 - s
        self.lam = max(0.0, self.lam + cfg.eta * (s - cfg.delta))
        self.steps_observed += 1
        self.straggler_steps += s
        if cfg.prompt_prior and prompt_keys is not None:
            self._update_history(lengths, prompt_keys)
        metrics = {"sagc/group_size": size, "sagc/lambda": self.lam, "sagc/straggler_event": s,
                   "sagc/straggler_ratio": ratio, "sagc/group_straggler_share": share,
                   "sagc/straggler_rate": self.straggler_steps / self.steps_observed}
        for g, a, b in zip(self.candidates, self.alpha, self.beta):
            metrics[f"sagc/p_hat/{g}"] = a / (a + b)
        if prior_q is not None:
            for g, q in zip(self.candidates, prior_q):
                metrics[f"sagc/prompt_prior/{g}"] = q
        return metrics

    def _update_history(self, lengths: Sequence[Sequence[int]], prompt_keys: Sequence[str]) -> None:
        w = self.cfg.prompt_ema
        for key, group in zip(prompt_keys, lengths):
            if not group:
                continue
            logs = [math.log(max(int(n), 1)) for n in group]
            m, m2 = sum(logs) / len(logs), sum(x * x for x in logs) / len(logs)
            old = self.prompt_history.get(key)
            self.prompt_history[key] = [m, m2] if old is None else [(1 - w) * old[0] + w * m, (1 - w) * old[1] + w * m2]
            self.length_cap = max(self.length_cap, float(max(group)))

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Everything the next decisions depend on, as JSON types."""
        version, internal, gauss_next = self.rng.getstate()
        return {"candidates": list(self.candidates), "size": self.size, "step": self.step, "lambda": self.lam,
                "alpha": list(self.alpha), "beta": list(self.beta), "rng": [version, list(internal), gauss_next],
                "steps_observed": self.steps_observed, "straggler_steps": self.straggler_steps,
                "prompt_history": {k: list(v) for k, v in self.prompt_history.items()},
                "length_cap": self.length_cap,
                "pending": {str(t): [g, q] for t, (g, q) in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["candidates"]) != self.candidates:
            raise ValueError(f"rollout.sagc.candidates: the checkpoint's controller has {state['candidates']}, "
                             f"this run {list(self.candidates)}")
        self.size, self.step, self.lam = int(state["size"]), state["step"], float(state["lambda"])
        self.alpha, self.beta = [float(a) for a in state["alpha"]], [float(b) for b in state["beta"]]
        version, internal, gauss_next = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss_next))
        v = state["straggler_steps"]     # an int under the step statistic, a sum of shares under group
        self.steps_observed, self.straggler_steps = int(state["steps_observed"]), int(v) if float(v).is_integer() else float(v)
        self.prompt_history = {k: [float(x) for x in v] for k, v in state["prompt_history"].items()}
        self.length_cap = float(state["length_cap"])
        self.pending = {int(t): (int(g), q) for t, (g, q) in state.get("pending", {}).items()}


register_group_sizer("fixed")(lambda rollout_cfg: FixedGroupSize(rollout_cfg.n))
register_group_sizer("sagc")(lambda rollout_cfg: StragglerAwareGroupSize(rollout_cfg.sagc, rollout_cfg.n))
