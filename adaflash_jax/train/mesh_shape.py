"""Mesh sizes from a device count: the one mesh filler.

The trainer (`train/mesh.py`), a run config (`distill/shapes.py`) and the memory planner all
size their (data, fsdp, tensor) mesh here, so a mesh that one accepts the others accept too.
Pure arithmetic: no devices are touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from adaflash_jax.model.config import ConfigError

AXES = ("data", "fsdp", "tensor")


def check_mesh(mesh: Sequence[int]) -> tuple[int, int, int]:
    """The sizes as ints: three of them, each positive or -1 (fill), at most one -1."""
    sizes = tuple(int(s) for s in mesh)
    if len(sizes) != 3:
        raise ConfigError(f"mesh must be three sizes (data, fsdp, tensor), got {tuple(mesh)}")
    for name, size in zip(AXES, sizes, strict=True):
        if size == 0 or size < -1:
            raise ConfigError(f"mesh axis {name}={size} must be a positive size or -1 (fill)")
    if sizes.count(-1) > 1:
        raise ConfigError(f"only one mesh axis may be -1 (fill), got {sizes}")
    return sizes


def fill_mesh(mesh, devices: int | None) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for `devices` chips; one -1 axis is filled from them.

    `devices=None` checks the sizes alone (a -1 then needs the count).
    """
    sizes = list(check_mesh(mesh))
    fixed = math.prod(s for s in sizes if s != -1)
    named = ", ".join(f"{a}={s}" for a, s in zip(AXES, sizes, strict=True) if s != -1)
    if -1 in sizes:
        fill = AXES[sizes.index(-1)]
        if devices is None:
            raise ConfigError(f"mesh axis {fill!r} is -1 (fill): pass the device count")
        if devices % fixed:
            raise ConfigError(
                f"{devices} devices cannot be split with {named}: their product {fixed} does "
                f"not divide the device count, so mesh axis {fill!r} cannot be filled"
            )
        sizes[sizes.index(-1)] = devices // fixed
    elif devices is not None and fixed != devices:
        raise ConfigError(
            f"mesh {named} uses {fixed} devices, but {devices} devices are available; change "
            "one of data/fsdp/tensor (or set one to -1)"
        )
    return tuple(sizes)
