"""TPU slice names → abstract devices for deviceless compiles (no TPU attached).

Accepted names:
- accelerator types as Cloud TPU spells them: `v5p-N` (N TensorCores, 2 per chip: v5p-64 is
  32 chips), `v5e-N` / `v5litepod-N` and `v6e-N` (N chips);
- libtpu topology strings: `v5p:2x4x4`, `v5e:2x4`, `v6e:8x8`.

A slice's shape follows Google's tables (v5p: 3-D, 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...;
v5e/v6e: 2-D, 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16). `abstract_devices` asks libtpu
for the topology (`jax.experimental.topologies.get_topology_desc`), as MaxText's
train_compile.py does; nothing initialises a TPU backend, so it works on a CPU machine with
`JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

from adaflash_jax.aot.chips import Chip, chip
from adaflash_jax.model.config import ConfigError

# power-of-two chip counts with a documented single-slice shape
_CHIP_COUNTS = {
    "v5p": tuple(2**k for k in range(2, 13)),  # v5p-8 .. v5p-8192
    "v5e": (1, 4, 8, 16, 32, 64, 128, 256),
    "v6e": (1, 4, 8, 16, 32, 64, 128, 256),
}
_HOST_SHAPE = {"v5p": (2, 2, 1), "v5e": (2, 4, 1), "v6e": (2, 4, 1)}
ACCEPTED = (
    "v5p-8|16|...|8192 (TensorCores), v5e-1|4|8|...|256 (alias v5litepod-N), "
    "v6e-1|4|8|...|256 (chips), or a topology such as v5p:2x2x1, v5e:2x4, v6e:8x8"
)


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as the user wrote it
    chip: Chip
    shape: tuple[int, ...]  # chips along each torus axis

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def topology(self) -> str:
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        dims = tuple(self.shape) + (1,) * (3 - len(self.shape))
        return tuple(min(d, h) for d, h in zip(dims, _HOST_SHAPE[self.chip.name]))

    @property
    def hosts(self) -> int:
        return max(1, self.chips // math.prod(self.chips_per_host_bounds))


def _shape(kind: str, chips: int) -> tuple[int, ...]:
    k = chips.bit_length() - 1
    if kind == "v5p":
        if chips == 4:
            return (2, 2, 1)
        return tuple(2 ** (k // 3 + (i >= 3 - k % 3)) for i in range(3))
    return (2 ** (k // 2), 2 ** (k - k // 2))


def parse_slice(name: str) -> Slice:
    """A `Slice` from a user name; a bad name is a one-line ConfigError listing the forms."""
    text = name.strip().lower().replace("v5litepod", "v5e")
    if m := re.fullmatch(r"(v5p|v5e|v6e):(\d+(?:x\d+){1,2})", text):
        kind, dims = m.group(1), tuple(int(d) for d in m.group(2).split("x"))
        want = 3 if kind == "v5p" else 2
        if len(dims) == want and all(d > 0 for d in dims):
            return Slice(name, chip(kind), dims)
    elif m := re.fullmatch(r"(v5p|v5e|v6e)-(\d+)", text):
        kind, n = m.group(1), int(m.group(2))
        c = chip(kind)
        if n % c.cores_per_chip == 0 and n // c.cores_per_chip in _CHIP_COUNTS[kind]:
            return Slice(name, c, _shape(kind, n // c.cores_per_chip))
    raise ConfigError(f"unknown TPU slice {name!r}; accepted: {ACCEPTED}")


def deviceless_libtpu_env() -> None:
    """Environment for loading libtpu only to compile (set before its first load; existing
    values are kept; none changes what is compiled):
    - libtpu takes a machine-wide lock file (/tmp/libtpu_lockfile) so that one process owns
      the TPU, and a second process fails to load it. Compiling owns no TPU, so several
      compiles (tests, a background run) may load it at once: ALLOW_MULTIPLE_LIBTPU_LOAD.
    - on a machine that is not a TPU VM it warns that it cannot find the worker host list
      and accelerator type: harmless defaults silence that."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")


@functools.cache
def abstract_devices(topology: str, chips_per_host_bounds: tuple[int, int, int]) -> tuple:
    """The abstract TPU devices of one slice (cached: libtpu builds each topology once)."""
    from jax.experimental import topologies

    deviceless_libtpu_env()
    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="default",
        chips_per_host_bounds=chips_per_host_bounds,
        num_slices=1,
    )
    return tuple(desc.devices)


def slice_devices(s: Slice) -> tuple:
    return abstract_devices(s.topology, s.chips_per_host_bounds)
