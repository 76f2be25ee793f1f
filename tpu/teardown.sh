#!/usr/bin/env bash
# Deletes the slice: the queued resource together with its TPU node (--force), which is also
# how a preempted (SUSPENDED) Spot request is cleared before re-creating it. Nothing on GCS
# is touched: checkpoints, logs and TensorBoard events in the run directory stay.
#   tpu/teardown.sh --project P --zone Z [--name adaflash] [--node-only]
# --node-only deletes just the TPU VM (one created without a queued resource).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TPU_NODE_ONLY=0
SWITCH_VARS[--node-only]=TPU_NODE_ONLY

usage() {
  cat <<USAGE
Usage: tpu/teardown.sh [flags] [-- extra gcloud flags, e.g. --async]
                       --node-only         delete only the TPU VM TPU_NAME
$COMMON_USAGE
USAGE
}

parse_flags "$@"
finish_settings
location_flags

if [[ $TPU_NODE_ONLY == 1 ]]; then
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOCATION[@]}" --quiet "${PASSTHRU_ARGS[@]}"
else
  run gcloud compute tpus queued-resources delete "$TPU_QR_ID" "${LOCATION[@]}" --force --quiet \
    "${PASSTHRU_ARGS[@]}"
fi
