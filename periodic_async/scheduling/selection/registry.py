"""The registry of selection rules (the package docstring says what a rule is)."""
from __future__ import annotations

import inspect
from typing import Callable

SelectionFactory = Callable[..., object]
SELECTIONS: dict[str, SelectionFactory | None] = {"none": None}


def register_selection(name: str) -> Callable[[SelectionFactory], SelectionFactory]:
    """Decorator: register `factory(rollout_cfg, batch_size, group_size, num_prompts[, max_staleness=eta])`
    under `name`."""
    def register(factory: SelectionFactory) -> SelectionFactory:
        if name in SELECTIONS and SELECTIONS[name] is not factory:
            raise ValueError(f"rollout.selection: '{name}' is registered twice")
        SELECTIONS[name] = factory
        return factory
    return register


def check_selection(name: str) -> None:
    """A one-line error naming the key for an unregistered name (before anything is built)."""
    if name not in SELECTIONS:
        from ...errors import ConfigError
        raise ConfigError(f"rollout.selection: unknown rule '{name}'; registered: {', '.join(sorted(SELECTIONS))}")


def build_selection(rollout_cfg, batch_size: int, group_size: int, num_prompts: int, max_staleness: int = 0):
    """The rule `rollout_cfg.selection` names, or None for `none`. A factory that takes a
    `max_staleness` keyword (trainer.max_staleness, eta) is given it; the others need not know it."""
    check_selection(rollout_cfg.selection)
    factory = SELECTIONS[rollout_cfg.selection]
    if factory is None:
        return None
    if "max_staleness" in inspect.signature(factory).parameters:
        return factory(rollout_cfg, batch_size, group_size, num_prompts, max_staleness=max_staleness)
    return factory(rollout_cfg, batch_size, group_size, num_prompts)

