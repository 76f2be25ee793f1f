"""Test configuration: 8 fake CPU devices for sharding tests, set before any backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny test models are compile-bound. A lower LLVM optimisation level and XLA:CPU's older
# elemental fusion emitter (instead of the MLIR fusion emitters) each cut compile times
# several-fold and leave results unchanged at the tolerances the tests use. One LLVM module
# per program (no parallel-codegen split) cuts compile time further on a 2-core machine
# and changes no generated code. Subprocesses the tests start inherit these
# flags through the environment.
for _flag in (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from adaflash_jax.model.presets import target_preset  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target_config():
    """The unit tests' target shape (`model/presets.py` "test")."""
    return target_preset("test")
