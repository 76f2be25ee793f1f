#!/usr/bin/env bash
# Starts the distillation job on every worker of the slice (each worker runs the same SPMD
# program; JAX finds its peers on a TPU pod by itself), detached with nohup, one log file per
# worker. Checkpoints and TensorBoard events go to the run directory on GCS, so launching
# again with the same run directory resumes from the latest checkpoint (after a preemption,
# re-create the slice and run setup.sh first).
#   tpu/launch.sh --bucket my-bucket [--config experiments/configs/qwen3_8b_v5p.py] [-- args]
#   tpu/launch.sh --logs    # last lines of every worker's log
#   tpu/launch.sh --stop    # stop the job on every worker
# Arguments after `--` are passed to `python -m experiments.distill`.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TPU_CONFIG="${TPU_CONFIG:-experiments/configs/qwen3_8b_v5p.py}"
TPU_RUN_NAME="${TPU_RUN_NAME:-}"
TPU_RUN_DIR="${TPU_RUN_DIR:-}"
TPU_STOP=0
TPU_LOGS=0
FLAG_VARS[--config]=TPU_CONFIG
FLAG_VARS[--run-name]=TPU_RUN_NAME
FLAG_VARS[--run-dir]=TPU_RUN_DIR
SWITCH_VARS[--stop]=TPU_STOP
SWITCH_VARS[--logs]=TPU_LOGS

REMOTE_CODE=adaflash_jax
REMOTE_VENV=adaflash_venv
REMOTE_LOGS=adaflash_logs

usage() {
  cat <<EOF
Usage: tpu/launch.sh [flags] [-- extra experiments.distill arguments]
  TPU_CONFIG           --config            run config (default experiments/configs/qwen3_8b_v5p.py)
  TPU_RUN_NAME         --run-name          run name (default: the config's file name)
  TPU_RUN_DIR          --run-dir           default gs://TPU_BUCKET/runs/TPU_RUN_NAME
                       --logs              print the last lines of every worker's log
                       --stop              stop the job on every worker
$COMMON_USAGE
EOF
}

parse_flags "$@"
finish_settings

# Single quotes on purpose: $(hostname), $(cat ...) and $! expand on each worker.
# shellcheck disable=SC2016
log='$HOME/'"$REMOTE_LOGS"'/distill-$(hostname).log'
pidfile="$REMOTE_LOGS/distill.pid"

if [[ $TPU_LOGS == 1 ]]; then
  tpu_ssh all "tail -n 30 $REMOTE_LOGS/distill-*.log"
  exit 0
fi
if [[ $TPU_STOP == 1 ]]; then
  # shellcheck disable=SC2016
  tpu_ssh all "if [ -f $pidfile ]; then kill \"\$(cat $pidfile)\" 2>/dev/null; rm -f $pidfile; fi; true"
  exit 0
fi

TPU_RUN_NAME="${TPU_RUN_NAME:-$(basename "$TPU_CONFIG" .py)}"
if [[ -z $TPU_RUN_DIR ]]; then
  require TPU_BUCKET --bucket
  TPU_RUN_DIR="gs://${TPU_BUCKET#gs://}/runs/$TPU_RUN_NAME"
fi

job=(-m experiments.distill --config "$TPU_CONFIG" --run-dir "$TPU_RUN_DIR" "${PASSTHRU_ARGS[@]}")
job_line=""
for arg in "${job[@]}"; do
  job_line+=" $(printf '%q' "$arg")"
done
# The persistent compilation cache on GCS makes a resumed job skip most of its compiles.
cache="$(printf '%q' "$TPU_RUN_DIR/xla_cache")"
# `;`-separated so that `&` detaches only the python process, whose pid is then recorded.
tpu_ssh all "mkdir -p $REMOTE_LOGS && cd $REMOTE_CODE || exit 1; \
if [ -f ~/$pidfile ] && kill -0 \"\$(cat ~/$pidfile)\" 2>/dev/null; then \
echo 'already running: tpu/launch.sh --stop first' >&2; exit 1; fi; \
JAX_COMPILATION_CACHE_DIR=$cache nohup ~/$REMOTE_VENV/bin/python$job_line \
>> $log 2>&1 < /dev/null & echo \$! > ~/$pidfile"

location_flags
cat <<EOF
# run directory (checkpoints, TensorBoard events): $TPU_RUN_DIR
# logs:        tpu/launch.sh --logs   (or follow worker 0:
#              $(command_line gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker=0 \
  --command="tail -f $REMOTE_LOGS/distill-*.log"))
# TensorBoard: tensorboard --logdir $TPU_RUN_DIR
# resume:      after a preemption: tpu/teardown.sh, tpu/create.sh --wait, tpu/setup.sh, then
#              this same launch (same --run-dir / --run-name); the job restores its checkpoint.
EOF
