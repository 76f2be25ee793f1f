"""adaflash_jax: AdaFlash speculative decoding (DFlash drafter + adaptive length head) in JAX."""

__version__ = "0.1.0"
