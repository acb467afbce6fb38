"""YAML file + `key=value` overrides -> the typed sections (sections.py), and back to a plain dict.

Every value is checked against its field's annotation; an unknown key or a wrong type is refused
with a message naming the dotted key and what is allowed, prefixed with the file's path.

Hand-written on purpose; both libraries were tried on these sections. OmegaConf 2.4.0 structured
configs convert instead of refusing (`trainer.tensorboard: 3` and `'yes'` become true,
`model.path: 3` becomes '3', `rollout.n: '4'` becomes 4), report `model.tiny: 5` without the key,
and read `${...}` in any string as an interpolation. dacite 1.9.2 names the key of a wrong type, but
reports an unknown key inside a section without its section or the allowed names, accepts `true`
for a float, and fails on `actor.betas: 5` with a bare TypeError, so it would need this module's
key walk and checks around it anyway.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

import yaml

from ..errors import ConfigError
from .sections import Config

__all__ = ["ConfigError", "config_from_dict", "config_to_dict", "load_config", "parse_override"]


def _describe(tp: Any) -> str:
    """What a value of annotation `tp` must look like, as an error message says it."""
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    if typing.get_origin(tp) is tuple or tp is tuple:
        args = typing.get_args(tp)
        if args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} {_plural(args[0])}"
        return f"a list of {_plural(args[0] if args else Any)}"
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}[tp]


def _plural(tp: Any) -> str:
    return {float: "numbers", int: "integers", bool: "booleans", str: "strings"}.get(tp, "values")


def _coerce(key: str, tp: Any, value: Any, nullable: bool = False) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted (as floats) where floats are asked for."""
    def wrong() -> ConfigError:
        return ConfigError(f"{key}: expected {_describe(tp)}{' or null' if nullable else ''}, "
                           f"got {type(value).__name__} {value!r}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config annotation {tp} for {key}")
        if value is None and type(None) in typing.get_args(tp):
            return None
        return _coerce(key, args[0], value, nullable=True)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise wrong()
        return _from_dict(tp, value, key + ".")
    if origin is tuple or tp is tuple:
        args = typing.get_args(tp)
        variable = not args or args[-1] is Ellipsis
        if not isinstance(value, (list, tuple)) or (not variable and len(value) != len(args)):
            raise wrong()
        item_types = [args[0] if args else float] * len(value) if variable else list(args)
        return tuple(_coerce(f"{key}[{i}]", t, v) for i, (t, v) in enumerate(zip(item_types, value)))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong()
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise wrong()
        return value
    raise TypeError(f"unsupported config annotation {tp} for {key}")


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown key; allowed under '{prefix.rstrip('.') or 'top level'}': "
                              f"{', '.join(sorted(names))}")
    return cls(**{k: _coerce(prefix + k, hints[k], v) for k, v in data.items()})


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"override '{dotted}': expected a dotted key such as actor.lr")
    for p in parts[:-1]:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{p}' is a value, not a section")
        tree = node
    tree[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'actor.lr=1e-3' -> ('actor.lr', 0.001); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. actor.lr=1e-3")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e})") from None
    # YAML 1.1 reads '1e-3' (no dot) as a string; accept the usual float spellings.
    if isinstance(value, str) and any(c in value for c in ".eE") and not value.isalpha():
        try:
            value = float(value)
        except ValueError:
            pass
    return key, value


def config_from_dict(data: dict) -> Config:
    """A plain nested dict (as YAML gives it) -> Config, checked key by key (not validated)."""
    return _from_dict(Config, data or {})


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load YAML (if given), apply `key=value` overrides, build typed dataclasses (not validated)."""
    tree: dict = {}
    if path:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping at top level, got {type(tree).__name__}")
    try:
        for ov in overrides or []:
            key, value = parse_override(ov)
            _set_dotted(tree, key, value)
        return config_from_dict(tree)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def config_to_dict(cfg: Config) -> dict:
    """Config -> plain dict of YAML types (tuples as lists), e.g. to write next to a run."""
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v
    return plain(dataclasses.asdict(cfg))
