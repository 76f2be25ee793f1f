"""Custom kernels whose cost XLA's estimate leaves out.

A Pallas/Mosaic kernel is an opaque custom call to XLA's cost analysis: its FLOPs, bytes and
time are missing from `cost_analysis()` (its buffers still count in `memory_analysis()`).
Every compile report lists the kernels registered here, so a figure that omits one says so.
Nothing in the project uses a custom kernel today; a module that adds one registers it at
import:

    from adaflash_jax.aot.kernels import register_uncosted_kernel
    register_uncosted_kernel("splash block attention", "drafter/attention.py, TPU path")
"""

from __future__ import annotations

UNCOSTED_KERNELS: dict[str, str] = {}  # kernel name → where it runs


def register_uncosted_kernel(name: str, where: str) -> None:
    UNCOSTED_KERNELS[name] = where


def uncosted_kernels() -> list[str]:
    """'name (where)' of every registered kernel, or [] when none."""
    return [f"{name} ({where})" for name, where in sorted(UNCOSTED_KERNELS.items())]
