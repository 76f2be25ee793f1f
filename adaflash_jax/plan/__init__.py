"""Memory planning for pod runs: per-device HBM of params, optimizer, activations, caches."""

from adaflash_jax.plan.advice import choose_mesh, format_advice, suggest
from adaflash_jax.plan.inputs import (
    TARGET_PRESETS,
    PlanInputs,
    inputs_from_config,
    target_preset,
)
from adaflash_jax.plan.memory_estimate import GIB, MemoryPlan, estimate, format_plan
from adaflash_jax.plan.params import DrafterShape, drafter_params, target_params

__all__ = [
    "GIB",
    "TARGET_PRESETS",
    "DrafterShape",
    "MemoryPlan",
    "PlanInputs",
    "choose_mesh",
    "drafter_params",
    "estimate",
    "format_advice",
    "format_plan",
    "inputs_from_config",
    "suggest",
    "target_params",
    "target_preset",
]
