"""A run directory keeps its recipe (docs/design.md §4.4): `config.json` holds the resolved
config of the start that wrote it, and a later start with the same `--run-dir` must resolve
to the same config, or it is refused with one line naming the fields that differ.

A change goes through without asking only when every differing field is declared safe in
`SAFE_FIELDS` / `_safe`: fields that change how the run is watched, saved or measured, not
what it trains (`eval.*`, logging, checkpoint cadence, distributed timeouts), and more
stage-2 rounds where the rounds already run stay exactly as they were. Anything else needs
`--allow-config-change`. Every accepted change, safe or allowed, is appended to
`config_changes.jsonl` (one JSON object a line: time, how it was accepted, each field's old
and new value) before `config.json` is rewritten, so the run directory says how its recipe
moved.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from adaflash_jax.distill.config import RunConfig
from adaflash_jax.io import fs
from adaflash_jax.model.config import ConfigError

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Fields (or whole sections, "eval.*") whose change leaves what the run trains as it was.
SAFE_FIELDS = (
    "eval.*",  # τ is measured again on every start, from the final checkpoints
    "run_dir",  # where, not what: `--run-dir` or `--set run_dir=` name the same directory
    "log_every",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.async_save",
    "distributed.*",
)
MISSING = "<absent>"  # a field one of the two configs does not have


def resolved(cfg: RunConfig) -> dict[str, Any]:
    """The config as `config.json` stores it (JSON types: tuples are lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """field → (old, new) for every dotted field whose stored values differ."""
    a, b = _flat(old), _flat(new)
    return {
        k: (a.get(k, MISSING), b.get(k, MISSING))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, MISSING) != b.get(k, MISSING)
    }


def _declared(field: str) -> bool:
    return any(field == s or (s.endswith(".*") and field.startswith(s[:-1])) for s in SAFE_FIELDS)


def _safe(field: str, was: Any, now: Any, new: dict[str, Any]) -> bool:
    """Whether changing `field` from `was` to `now` (in the new config `new`) keeps what the
    run has trained valid. More stage-2 rounds append rounds after the ones run (stage 2's
    learning rate is constant), unless a stage follows the rounds and would not rerun: the
    head re-fit (`stage2.head_refit`) or `stage1_long`, whose cosine schedule spans them."""
    if _declared(field):
        return True
    if field == "stage2.rounds" and isinstance(was, int) and isinstance(now, int):
        s2 = new["stage2"]
        return now > was and not s2["head_refit"] and "stage1_long" not in s2["methods"]
    return False


def unsafe_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The differences that are not declared safe."""
    diff = differences(old, new)
    return {k: v for k, v in diff.items() if not _safe(k, *v, new)}


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in changes.items())


def check_and_record(run_dir: str, cfg: RunConfig, *, allow_change: bool, write: bool) -> dict:
    """Compares `cfg` with the run directory's `config.json`: the first start (none there)
    writes it; the same config passes; a config differing in a field that is not safe is a
    `ConfigError` naming each such field with both values, unless `allow_change`. An accepted
    change is appended to `config_changes.jsonl`, then `config.json` rewritten. `write`:
    whether this process writes (process 0); every process checks. Returns the differences
    accepted (empty: none)."""
    path, new = f"{run_dir}/{CONFIG_FILE}", resolved(cfg)
    if not fs.exists(path):
        if write:
            fs.write_text(path, json.dumps(new, indent=2))
        return {}
    old = json.loads(fs.read_text(path))
    diff = differences(old, new)
    if not diff:
        return {}
    unsafe = unsafe_changes(old, new)
    if unsafe and not allow_change:
        raise ConfigError(
            f"run directory {run_dir} was started with another config ({CONFIG_FILE}): "
            f"{_describe(unsafe)}; resume with the recorded values, start a new --run-dir, or "
            f"pass --allow-config-change to change it (recorded in {CHANGES_FILE})"
        )
    if write:
        record = {
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "accepted": "allowed" if unsafe else "safe",
            "changes": {k: {"old": a, "new": b} for k, (a, b) in diff.items()},
        }
        changes = f"{run_dir}/{CHANGES_FILE}"
        before = fs.read_text(changes) if fs.exists(changes) else ""
        fs.write_text(changes, before + json.dumps(record) + "\n")
        fs.write_text(path, json.dumps(new, indent=2))
    return diff
