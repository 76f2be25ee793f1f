"""Decoding: sampling distributions and plain batched generation with the target."""
