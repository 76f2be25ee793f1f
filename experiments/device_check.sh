#!/usr/bin/env bash
# shellcheck disable=SC2054  # commas inside array elements are flag values (1,2,4)
# Issue-6 GPU check: one H200, no network, no grain, under 8 minutes.
#   bash experiments/device_check.sh            # on the device machine
#   SMOKE=1 bash experiments/device_check.sh    # CPU rehearsal: same commands, tiny sizes
# Builds the `small` target (pretrain_target) and its drafters (distill, configs/small.py with
# fewer steps), runs the throughput benchmark at c = 128, 64, 32, 1 (highest first: a cut-short
# run keeps the finished levels), times the Qwen3-8B-shaped verify/draft costs, and projects
# 8B throughput from the measured acceptance. Each part has its own budget (`timeout`); a part
# that fails or runs out is logged and later parts fall back (checkpoint exports, untrained
# drafters, the stored H200 cost files). Writes 8 files into $OUT: device_check.log,
# bench.json, bench_traces.json, bench.md, throughput.png, tau.png, shape_cost.json,
# projection.json. Scratch (targets, run dirs, caches) goes to $WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/adaflash_device_check}
WORK=${WORK:-$(mktemp -d /tmp/adaflash_check.XXXXXX)}
mkdir -p "$OUT" "$WORK"
export ADAFLASH_CACHE="$WORK/cache" ADAFLASH_CACHE_DIR="$WORK/cache"
export JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"  # shared by the parts' processes
LOG="$OUT/device_check.log"
: >"$LOG"
START=$SECONDS
RC=0

log() { echo "[$((SECONDS - START))s] $*" | tee -a "$LOG"; }
part() {  # part NAME BUDGET_S CMD...: sets RC, never aborts the script
  local name=$1 budget=$2
  shift 2
  log "== $name (budget ${budget}s): $*"
  local t0=$SECONDS
  RC=0
  timeout --kill-after=5 "$budget" "$@" 2>&1 | tee -a "$LOG" || RC=$?
  log "== $name: exit $RC after $((SECONDS - t0))s"
}

TARGET="$WORK/target"
RUN="$WORK/run"
BENCH="$WORK/bench"
if [[ "${SMOKE:-0}" == 1 ]]; then
  PRESET=micro PRETRAIN_STEPS=${PRETRAIN_STEPS:-3}
  # order matters: each override is validated against the fields set so far
  DISTILL_SETS=(data.max_prompt_len=24 batch_size=8 seq_len=64 num_anchors=4
    compute_dtype=float32 data.train_per_domain=4 data.eval_per_domain=2 data.max_new_tokens=16
    data.regen_batch=8 draft.layers=1 draft.block_size=4 draft.num_features=2 stage1.steps=2
    head_init.steps=2 stage2.steps_per_round=2 stage2.prompts_per_round=4
    stage2.collect_slots=8 eval.slots=8)
  BENCH_ARGS=(--concurrency 4,2,1 --prompts-per-domain 2 --max-new-tokens 8 --max-prompt-len 16)
  SHAPE_ARGS=(--shape tiny --batches 1,2 --widths 1,4 --context 32 --iters 2 --draft-layers 1
    --block-size 4)
  UNTRAINED=(--layers 1 --block-size 4 --num-features 2)
  B_PRETRAIN=${B_PRETRAIN:-120} B_DISTILL=${B_DISTILL:-240} B_BENCH=${B_BENCH:-300}
  B_SHAPE=${B_SHAPE:-90}
else
  PRESET=small PRETRAIN_STEPS=${PRETRAIN_STEPS:-300}
  DISTILL_SETS=(data.train_per_domain=128 data.eval_per_domain=8 data.max_new_tokens=128
    stage1.steps=200 head_init.steps=30 stage2.steps_per_round=30 stage2.prompts_per_round=64
    checkpoint.every=100000)
  # goodput's costs: the bench's one cost table (the engine's loop programs per concurrency);
  # one timed round per cell (the CPU default of two fights this CPU's drift, not the GPU's)
  BENCH_ARGS=(--concurrency 128,64,32,1 --prompts-per-domain 16 --max-new-tokens 64
    --max-prompt-len 64 --repeats 1)
  SHAPE_ARGS=(--shape qwen3-8b --batches 1,128 --widths 1,4,16 --context 1024 --iters 5
    --draft-layers 5 --block-size 16)
  UNTRAINED=(--layers 3 --block-size 16)
  # ~465 s in all: each part's programs compile once (a 12-layer verify switch, the 8B shape
  # ~10 s per cell); the benchmark gets the most, its highest concurrency runs first.
  B_PRETRAIN=${B_PRETRAIN:-80} B_DISTILL=${B_DISTILL:-100} B_BENCH=${B_BENCH:-180}
  B_SHAPE=${B_SHAPE:-90}
fi
SETS=(--set "stage2.rounds=${STAGE2_ROUNDS:-1}" --set "stage2.methods=('adaflash',)")
for kv in "${DISTILL_SETS[@]}"; do SETS+=(--set "$kv"); done

log "device check: SMOKE=${SMOKE:-0} OUT=$OUT WORK=$WORK"
{ nvidia-smi -L 2>/dev/null || true; } | tee -a "$LOG"
"$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  2>&1 | tee -a "$LOG"

# 1. the small target
part pretrain "$B_PRETRAIN" "$PY" -m experiments.pretrain_target --preset "$PRESET" \
  --out "$TARGET" --steps "$PRETRAIN_STEPS"
HAVE_TARGET=0
[[ -f "$TARGET/model.safetensors" && -f "$TARGET/tokenizer.json" ]] && HAVE_TARGET=1

# 2. its drafters: stage 1 (DFlash-style) and AdaFlash, then fallbacks. An explicit target
# needs prompt files: the preset's embedded prompts, written out.
BENCH_IN=()
if [[ $HAVE_TARGET == 1 ]]; then
  part prompts 60 "$PY" -c "
import json
from adaflash_jax import embedded
for split, get in (('train', embedded.train_prompts), ('eval', embedded.eval_prompts)):
    with open('$WORK/' + split + '_prompts.jsonl', 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in get(preset='$PRESET'))
"
  SETS+=(--set "data.train_prompts=$WORK/train_prompts.jsonl")
  SETS+=(--set "data.eval_prompts=$WORK/eval_prompts.jsonl")
  part distill "$B_DISTILL" "$PY" -m experiments.distill --config experiments/configs/small.py \
    --target "$TARGET" --run-dir "$RUN" --no-progress "${SETS[@]}"
  if [[ -f "$RUN/report.json" ]]; then
    "$PY" -c "import json; r = json.load(open('$RUN/report.json')); print(json.dumps(
      {k: r[k] for k in ('tau', 'summary', 'stage_seconds', 'wall_s')}, indent=1))" \
      2>&1 | tee -a "$LOG" || true
  fi
  METHODS=plain,stage1:fixed,adaflash:fixed,adaflash:adaflash,adaflash:goodput
  if compgen -G "$RUN/export/*/config.json" >/dev/null; then
    BENCH_IN=(--run-dir "$RUN")
    # distilled AdaFlash drafters carry the per-position acceptance output
    METHODS+=,adaflash:goodput:estimator=head
  elif [[ -d "$RUN/ckpt/stage1" ]]; then
    log "distill did not finish: exporting its latest checkpoints"
    part export_stage1 60 "$PY" -m experiments.export "$RUN/ckpt/stage1" --out "$WORK/x/stage1"
    part export_latest 60 "$PY" -m experiments.export "$RUN" --out "$WORK/x/adaflash"
    if [[ -f "$WORK/x/stage1/config.json" && -f "$WORK/x/adaflash/config.json" ]]; then
      BENCH_IN=(--target "$TARGET" --stage1 "$WORK/x/stage1" --adaflash "$WORK/x/adaflash")
    fi
  fi
  if [[ ${#BENCH_IN[@]} == 0 ]]; then
    log "no trained drafters: benchmarking UNTRAINED drafters (tau ~ 1)"
    part init_drafter 60 "$PY" -m experiments.init_drafter --target "$TARGET" \
      --out "$WORK/untrained" "${UNTRAINED[@]}"
    BENCH_IN=(--target "$TARGET" --stage1 "$WORK/untrained" --adaflash "$WORK/untrained")
  fi

  # 3. throughput vs concurrency (writes its outputs after every level)
  part benchmark "$B_BENCH" "$PY" -m experiments.benchmark "${BENCH_IN[@]}" --out "$BENCH" \
    --methods "$METHODS" "${BENCH_ARGS[@]}"
  for f in bench.json bench_traces.json bench.md throughput.png tau.png; do
    if [[ -f "$BENCH/$f" ]]; then cp "$BENCH/$f" "$OUT/$f"; fi
  done
else
  log "no target was built: skipping distill and benchmark"
fi

# 4. Qwen3-8B-shaped verify / draft costs (random bf16 weights)
part shape_costs "$B_SHAPE" "$PY" -m experiments.benchmark_decode "${SHAPE_ARGS[@]}" \
  --json "$WORK/shape.json" --cost-table "$OUT/shape_cost.json"

# 5. projection of the 8B-shape throughput from the measured acceptance
if [[ -f "$OUT/bench_traces.json" ]]; then
  COST=(--json "$OUT/projection.json")
  if [[ -f "$OUT/shape_cost.json" ]]; then COST+=(--cost "$OUT/shape_cost.json"); fi
  part projection 60 "$PY" -m experiments.project_throughput --traces "$OUT/bench_traces.json" \
    "${COST[@]}"
fi
log "done in $((SECONDS - START))s; files in $OUT:"
find "$OUT" -maxdepth 1 -type f -printf "%s\t%f\n" | tee -a "$LOG"
