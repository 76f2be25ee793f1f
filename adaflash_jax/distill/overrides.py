"""Dotted command-line overrides of a run config (`stage1.steps=10`, `mesh=(1,8,1)`): each
string is parsed into its field's type and an unknown name fails, naming it."""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from typing import Any

from adaflash_jax.distill.config import RunConfig
from adaflash_jax.model.config import ConfigError


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Parses a command-line string into the field's type."""
    if not isinstance(value, str):
        return value
    hint = annotation if not isinstance(annotation, str) else None
    if hint is str or (isinstance(hint, types.UnionType) and str in typing.get_args(hint)):
        try:  # a quoted string or None; anything else is taken verbatim
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
        return parsed if isinstance(parsed, str) or parsed is None else value
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ConfigError(f"{where}: cannot parse {value!r}") from None
    if hint is float and isinstance(parsed, int):
        parsed = float(parsed)
    if isinstance(parsed, list):
        parsed = tuple(parsed)
    return parsed


def override(cfg: RunConfig, assignments: dict[str, Any]) -> RunConfig:
    """Applies {"stage1.steps": "10", "mesh": (1, 8, 1), ...}; unknown names fail."""
    for dotted, value in assignments.items():
        cfg = _set(cfg, dotted.split("."), value, dotted)
    return cfg


def _set(obj: Any, path: list[str], value: Any, dotted: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    head = path[0]
    if head not in fields:
        raise ConfigError(f"unknown config field {dotted!r} ({head!r} not in {sorted(fields)})")
    if len(path) == 1:
        hints = typing.get_type_hints(type(obj))
        return dataclasses.replace(obj, **{head: _coerce(value, hints.get(head), dotted)})
    child = getattr(obj, head)
    if not dataclasses.is_dataclass(child):
        raise ConfigError(f"config field {'.'.join(path[:1])!r} has no sub-fields ({dotted})")
    return dataclasses.replace(obj, **{head: _set(child, path[1:], value, dotted)})
