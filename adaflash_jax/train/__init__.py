"""Shared training machinery (mesh, optimizer, sharded state and step, checkpoints, logging),
used by target pretraining and by drafter distillation."""
