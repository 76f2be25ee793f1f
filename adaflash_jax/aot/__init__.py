"""Deviceless TPU compiles of the project's own programs: per-chip memory and compiler
estimates of FLOPs and step time for a Cloud TPU slice, with no TPU attached."""
