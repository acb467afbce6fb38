"""The registry of selection rules (the package docstring says what a rule is)."""
from __future__ import annotations

from typing import Callable

SelectionFactory = Callable[..., object]
SELECTIONS: dict[str, SelectionFactory | None] = {"none": None}


def register_selection(name: str) -> Callable[[SelectionFactory], SelectionFactory]:
    """Decorator: register `factory(rollout_cfg, batch_size, group_size, num_prompts)` under `name`."""
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


def build_selection(rollout_cfg, batch_size: int, group_size: int, num_prompts: int):
    """The rule `rollout_cfg.selection` names, or None for `none`."""
    check_selection(rollout_cfg.selection)
    factory = SELECTIONS[rollout_cfg.selection]
    return None if factory is None else factory(rollout_cfg, batch_size, group_size, num_prompts)

