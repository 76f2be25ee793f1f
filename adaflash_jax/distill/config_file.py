"""Loading a config file (`experiments/configs/<name>.py`): the one loader the run, the
planner and the compile CLIs share."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from adaflash_jax.distill.config import RunConfig
from adaflash_jax.model.config import ConfigError


def load_config_file(path: str | os.PathLike) -> Any:
    """The config object a config file defines: its `get_config()`, else its `CONFIG` (or
    `config`) attribute. The one loader (the memory planner reads any such object)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file does not exist: {path}")
    spec = importlib.util.spec_from_file_location(f"_run_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "get_config"):
        return module.get_config()
    for name in ("CONFIG", "config"):
        if hasattr(module, name):
            return getattr(module, name)
    raise ConfigError(f"{path} defines neither get_config() nor CONFIG")


def load_config(path: str | os.PathLike) -> RunConfig:
    """The `RunConfig` of a config file."""
    cfg = load_config_file(path)
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not RunConfig")
    return cfg
