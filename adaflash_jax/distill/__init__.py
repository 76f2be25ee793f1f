"""Drafter training: stage-1 DFlash init, length-head init, stage-2 AdaFlash distillation."""
