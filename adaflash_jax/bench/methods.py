"""The methods a throughput benchmark compares: plain decoding, or a named drafter under a
length policy with keyword options, as written on the command line
(`adaflash:adaflash:threshold=0,rate=1.3`)."""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from adaflash_jax.decode.tree import TreeShape

DEFAULT_METHODS = (
    "plain",
    "stage1:fixed",
    "adaflash:fixed",
    "adaflash:adaflash",
    "adaflash:goodput",
)
POLICIES = ("fixed", "adaflash", "goodput", "tree-batch")
ENGINE_OPTIONS = ("verify", "tree")  # method options for the engine, not the policy


class BenchError(ValueError):
    """A benchmark setting or input that cannot run (checked before any compute)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """`drafter=None` is plain decoding; otherwise a named drafter with a length policy."""

    drafter: str | None = None
    policy: str | None = None
    options: tuple[tuple[str, Any], ...] = ()  # policy keyword overrides, engine options

    @property
    def engine_options(self) -> dict:
        """`tree=TOPKxNODES` as a `TreeShape` (its verify is packed)."""
        out = {k: v for k, v in self.options if k in ENGINE_OPTIONS}
        if "tree" in out:
            out["tree"] = TreeShape.parse(out["tree"])
        return out

    @property
    def policy_options(self) -> dict:
        return {k: v for k, v in self.options if k not in ENGINE_OPTIONS}

    def __post_init__(self):
        if (self.drafter is None) != (self.policy is None):
            raise BenchError("a method is plain (no drafter, no policy) or drafter:policy")
        if self.policy is not None and self.policy not in POLICIES:
            raise BenchError(f"unknown policy {self.policy!r}; choose from {POLICIES}")
        try:
            self.engine_options  # noqa: B018 (a tree that does not parse is refused here)
        except ValueError as e:
            raise BenchError(f"method {self.label}: {e}") from None

    @property
    def label(self) -> str:
        if self.drafter is None:
            return "plain"
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.drafter}/{self.policy}" + (f"({opts})" if opts else "")


def parse_method(text: str) -> Method:
    """'plain', 'stage1:fixed', 'adaflash:goodput', 'adaflash:adaflash:threshold=0,rate=1.3',
    'adaflash:adaflash:verify=packed', 'adaflash:fixed:tree=2x16' (a per-row node budget),
    'adaflash:tree-batch:tree=2x32,mean_nodes=8' (`ENGINE_OPTIONS` go to the engine);
    options may also be joined by '+', which a comma-separated method list keeps whole."""
    parts = text.strip().split(":")
    if parts == ["plain"]:
        return Method()
    if len(parts) not in (2, 3) or not all(parts[:2]):
        raise BenchError(f"method {text!r}: expected 'plain' or DRAFTER:POLICY[:key=value,...]")
    options = []
    for kv in parts[2].replace("+", ",").split(",") if len(parts) == 3 and parts[2] else ():
        if "=" not in kv:
            raise BenchError(f"method {text!r}: option {kv!r} is not key=value")
        key, value = kv.split("=", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a bare string, e.g. estimator=confidence
        options.append((key.strip(), value))
    return Method(drafter=parts[0], policy=parts[1], options=tuple(options))
