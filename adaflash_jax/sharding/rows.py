"""The rows of a decoding batch spread over the mesh's batch axes (docs/design.md §8).

Dimensions: B rows (slots of the engine, or regeneration's batch).

A decoder's state holds every row's KV caches: at the 8B recipe's 256 collection slots that
is far more than one chip's HBM if every chip keeps every row. `RowLayout` names the mesh axes
the rows are split over (the rule table's "batch" axes); the decoding programs constrain their
state and their fresh caches to it, so each chip holds B / (data · fsdp) rows, while the
weights keep whatever layout the model's parameters have (FSDP-gathered per layer in the
distill run, as in its train steps). Sharding constraints never change values: a sharded
decode is bit-identical to an unsharded one (tests/test_row_layout.py).

Leaves whose leading dimension is not the row count (scalars, eos ids, a policy's scalar
state) stay replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaflash_jax.sharding.rules import Rules, logical_to_spec


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Rows over `axes` of `mesh` (hashable: a static argument of the decoding programs)."""

    mesh: Mesh
    axes: str | tuple[str, ...]

    @classmethod
    def of(cls, mesh: Mesh | None, rules: Rules, rows: int) -> RowLayout | None:
        """The layout of `rows` rows under `rules` ("batch" axes that divide `rows`), or None
        when they stay whole (no mesh, a one-device batch axis, or an indivisible count)."""
        if mesh is None:
            return None
        axes = logical_to_spec(("batch",), (rows,), mesh, rules)[0]
        return None if axes is None else cls(mesh, axes)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.axes,) if isinstance(self.axes, str) else tuple(self.axes)

    @property
    def size(self) -> int:
        return int(np.prod([self.mesh.shape[n] for n in self.names]))

    def sharding(self, ndim: int, split: bool = True) -> NamedSharding:
        """An array of rank `ndim` split over the rows (`split`) or replicated."""
        lead = (self.axes,) if split else ()
        return NamedSharding(self.mesh, PartitionSpec(*lead, *(None,) * (ndim - len(lead))))

    def _splits(self, x, rows: int) -> bool:
        return x.ndim >= 1 and x.shape[0] == rows and rows % self.size == 0

    def constrain(self, tree, rows: int):
        """Inside a jitted program: every leaf with `rows` leading rows split over the axes."""
        return jax.tree.map(
            lambda x: (
                jax.lax.with_sharding_constraint(x, self.sharding(x.ndim))
                if self._splits(x, rows)
                else x
            ),
            tree,
        )

    def shardings(self, tree, rows: int):
        """The NamedSharding of each leaf (row-split or replicated), for placing or lowering."""
        return jax.tree.map(lambda x: self.sharding(x.ndim, self._splits(x, rows)), tree)

    def place(self, tree, rows: int):
        """Outside jit: puts a host or single-device tree into this layout."""
        return jax.device_put(tree, self.shardings(tree, rows))


def constrain_rows(layout: RowLayout | None, tree, rows: int):
    """`layout.constrain`, or the tree unchanged without a layout."""
    return tree if layout is None else layout.constrain(tree, rows)


def fetch(tree):
    """Host NumPy copies of device arrays, also when rows live on other processes' chips."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)
