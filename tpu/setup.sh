#!/usr/bin/env bash
# Installs the project on every worker of a TPU VM / pod slice:
#   1. the code: `git clone` of TPU_REPO_URL at TPU_REPO_REF, or (default) a tarball of this
#      checkout's HEAD copied with `gcloud compute tpus tpu-vm scp`;
#   2. Python >= 3.11 (TPU images ship Ubuntu 22.04's 3.10; deadsnakes provides 3.11), a venv,
#      jax[tpu] pinned to TPU_JAX_VERSION with Google's libtpu find-links, `pip install -e`
#      (which brings gcsfs and tensorboardX: run directories and logs on gs://);
#   3. optionally the target checkpoint, copied from GCS to local disk on each worker
#      (the safetensors reader memory-maps local files).
# Ends by printing each worker's JAX device count, which needs every worker of the slice.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TPU_REPO_URL="${TPU_REPO_URL:-}"
TPU_REPO_REF="${TPU_REPO_REF:-main}"
TPU_JAX_VERSION="${TPU_JAX_VERSION:-0.10.2}"
TPU_PYTHON="${TPU_PYTHON:-python3.11}"
TPU_SYNC_MODEL="${TPU_SYNC_MODEL:-}"
TPU_MODEL_DIR="${TPU_MODEL_DIR:-models}"
FLAG_VARS[--repo-url]=TPU_REPO_URL
FLAG_VARS[--repo-ref]=TPU_REPO_REF
FLAG_VARS[--jax-version]=TPU_JAX_VERSION
FLAG_VARS[--python]=TPU_PYTHON
FLAG_VARS[--sync-model]=TPU_SYNC_MODEL
FLAG_VARS[--model-dir]=TPU_MODEL_DIR

# Remote layout, relative to each worker's home directory.
REMOTE_CODE=adaflash_jax
REMOTE_VENV=adaflash_venv
LIBTPU_LINKS=https://storage.googleapis.com/jax-releases/libtpu_releases.html

usage() {
  cat <<EOF
Usage: tpu/setup.sh [flags]
  TPU_REPO_URL         --repo-url          git URL to clone (default: copy this checkout's HEAD)
  TPU_REPO_REF         --repo-ref          branch, tag or commit to check out (default main)
  TPU_JAX_VERSION      --jax-version       jax[tpu] version (default 0.10.2; ours: >=0.10.2,<0.12)
  TPU_PYTHON           --python            interpreter for the venv (default python3.11)
  TPU_SYNC_MODEL       --sync-model        gs:// HF checkpoint dir to copy to every worker
  TPU_MODEL_DIR        --model-dir         where it lands, under ~ (default models)
$COMMON_USAGE
EOF
}

parse_flags "$@"
finish_settings
location_flags

# 1. code
if [[ -n $TPU_REPO_URL ]]; then
  url="$(printf '%q' "$TPU_REPO_URL")"
  ref="$(printf '%q' "$TPU_REPO_REF")"
  tpu_ssh all "{ [ -d $REMOTE_CODE/.git ] || git clone --quiet $url $REMOTE_CODE; } && \
git -C $REMOTE_CODE fetch --quiet origin $ref && git -C $REMOTE_CODE checkout --quiet --force FETCH_HEAD"
else
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  tarball="${TMPDIR:-/tmp}/adaflash_jax.tar.gz"
  git -C "$root" rev-parse --git-dir >/dev/null 2>&1 ||
    die "$root is not a git checkout: pass --repo-url to clone on the workers instead"
  if [[ $TPU_DRY_RUN != 1 ]] && [[ -n "$(git -C "$root" status --porcelain)" ]]; then
    echo "warning: uncommitted changes are not copied (the tarball is HEAD)" >&2
  fi
  run git -C "$root" archive --format=tar.gz --output="$tarball" HEAD
  run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:adaflash_jax.tar.gz" "${LOCATION[@]}" \
    --worker=all
  tpu_ssh all "rm -rf $REMOTE_CODE && mkdir -p $REMOTE_CODE && \
tar -xzf adaflash_jax.tar.gz -C $REMOTE_CODE"
fi

# 2. Python, jax[tpu], the project
py="$(printf '%q' "$TPU_PYTHON")"
pip="$REMOTE_VENV/bin/pip"
tpu_ssh all "{ command -v $py >/dev/null || { sudo apt-get update -q && \
sudo apt-get install -y -q software-properties-common && \
sudo add-apt-repository -y ppa:deadsnakes/ppa && \
sudo apt-get install -y -q $py ${py}-venv; }; } && \
$py -m venv $REMOTE_VENV && $pip install -q -U pip && \
$pip install -q 'jax[tpu]==$TPU_JAX_VERSION' -f $LIBTPU_LINKS && \
$pip install -q -e $REMOTE_CODE"

# 3. target checkpoint (optional)
if [[ -n $TPU_SYNC_MODEL ]]; then
  [[ $TPU_SYNC_MODEL == gs://* ]] || die "--sync-model must be a gs:// path, got $TPU_SYNC_MODEL"
  dest="$(printf '%q' "$TPU_MODEL_DIR")"
  tpu_ssh all "mkdir -p $dest && gcloud storage cp -r $(printf '%q' "$TPU_SYNC_MODEL") $dest/"
fi

# gcsfs (gs:// run directories) comes with the project's dependencies; importing it here
# fails the set-up early on a worker that lacks it.
tpu_ssh all "$REMOTE_VENV/bin/python -c 'import gcsfs, jax; \
print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
