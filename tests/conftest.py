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
