"""The DFlash block-diffusion drafter, its AdaFlash length head, and their on-disk format."""
