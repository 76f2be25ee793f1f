#!/usr/bin/env bash
# Requests a TPU VM / pod slice through a queued resource (Google's recommended way to get
# capacity) and, with --wait, blocks until it is ACTIVE.
#   tpu/create.sh --project P --zone us-east5-a --accelerator v5p-64 [--spot] [--wait]
# Arguments after `--` go to `gcloud compute tpus queued-resources create` unchanged
# (e.g. -- --valid-until-duration=6h --reserved).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TPU_WAIT="${TPU_WAIT:-0}"
TPU_POLL_SECONDS="${TPU_POLL_SECONDS:-60}"
SWITCH_VARS[--wait]=TPU_WAIT

usage() {
  cat <<EOF
Usage: tpu/create.sh [flags] [-- extra gcloud flags]
Creates queued resource TPU_QR_ID holding one TPU node TPU_NAME.
  TPU_WAIT=1           --wait              poll until the queued resource is ACTIVE
$COMMON_USAGE
EOF
}

parse_flags "$@"
finish_settings
location_flags

create=(gcloud compute tpus queued-resources create "$TPU_QR_ID"
  --node-id="$TPU_NAME" "${LOCATION[@]}"
  --accelerator-type="$TPU_ACCELERATOR" --runtime-version="$TPU_RUNTIME_VERSION")
if [[ $TPU_SPOT == 1 ]]; then
  create+=(--spot)
fi
run "${create[@]}" "${PASSTHRU_ARGS[@]}"

describe=(gcloud compute tpus queued-resources describe "$TPU_QR_ID" "${LOCATION[@]}"
  --format='value(state.state)')
if [[ $TPU_WAIT != 1 ]]; then
  echo "# check its state with: $(command_line "${describe[@]}")"
  exit 0
fi
echo "+ $(command_line "${describe[@]}")"
[[ $TPU_DRY_RUN == 1 ]] && exit 0
echo "# polled every ${TPU_POLL_SECONDS}s until ACTIVE"
while true; do
  state="$("${describe[@]}")"
  echo "queued resource $TPU_QR_ID: ${state:-unknown}"
  case "$state" in
    ACTIVE) exit 0 ;;
    FAILED | SUSPENDED) die "queued resource $TPU_QR_ID is $state; delete it (tpu/teardown.sh)" ;;
  esac
  sleep "$TPU_POLL_SECONDS"
done
