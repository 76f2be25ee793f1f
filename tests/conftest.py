"""Test configuration: 8 fake CPU devices for sharding tests, set before any backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny test models are compile-bound: a lower LLVM optimisation level cuts XLA:CPU compile
# times several-fold and leaves results unchanged at the tolerances the tests use.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from adaflash_jax.model.presets import target_preset  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target_config():
    """The unit tests' target shape (`model/presets.py` "test")."""
    return target_preset("test")
