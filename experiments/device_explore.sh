#!/usr/bin/env bash
# One-off GPU exploration: 8B-shape decode/verify forward timings and XLA flag variants.
# Usage on the device machine: bash experiments/device_explore.sh  (writes under $OUT)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi -L
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  echo "== default flags, B=1"
  timeout 150 python3 -m experiments.benchmark_forward --shape qwen3-8b --batches 1 --widths 1,2,16 --iters 10 --json "$OUT/b1_default.json"
  echo "== triton gemm off, B=1"
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 60 python3 -m experiments.benchmark_forward --shape qwen3-8b --batches 1 --widths 1,2 --iters 20 --json "$OUT/b1_notriton.json"
  echo "== default flags, B=32,128"
  timeout 90 python3 -m experiments.benchmark_forward --shape qwen3-8b --batches 32 --widths 4,16 --iters 5 --json "$OUT/bN_default.json"
} 2>&1 | tee "$OUT/explore.log"
