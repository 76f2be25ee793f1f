# shellcheck shell=bash disable=SC2034  # the variables are read by the scripts sourcing this
# Shared by tpu/*.sh (sourced, never run): settings from environment variables or flags, and
# `run`, which prints every command as `+ cmd args...` and executes it unless --dry-run.
# Values containing shell metacharacters are printed single-quoted, so each printed line is
# also a valid shell command (tests parse them with shlex).

# ---- settings: environment first, flags override ------------------------------------------
TPU_PROJECT="${TPU_PROJECT:-}"
TPU_ZONE="${TPU_ZONE:-}"
TPU_ACCELERATOR="${TPU_ACCELERATOR:-v5p-8}"
TPU_RUNTIME_VERSION="${TPU_RUNTIME_VERSION:-}"
TPU_NAME="${TPU_NAME:-adaflash}"
TPU_QR_ID="${TPU_QR_ID:-}"
TPU_BUCKET="${TPU_BUCKET:-}"
TPU_SPOT="${TPU_SPOT:-0}"
TPU_DRY_RUN="${TPU_DRY_RUN:-0}"

# Value flags shared by every script; a script adds its own before calling parse_flags.
declare -A FLAG_VARS=(
  [--project]=TPU_PROJECT
  [--zone]=TPU_ZONE
  [--accelerator]=TPU_ACCELERATOR
  [--runtime-version]=TPU_RUNTIME_VERSION
  [--name]=TPU_NAME
  [--qr-id]=TPU_QR_ID
  [--bucket]=TPU_BUCKET
)
# Switch flags: set the variable to 1.
declare -A SWITCH_VARS=(
  [--dry-run]=TPU_DRY_RUN
  [--spot]=TPU_SPOT
  [--preemptible]=TPU_SPOT
)
PASSTHRU_ARGS=()

COMMON_USAGE="Settings (environment variable / flag):
  TPU_PROJECT          --project           GCP project (required)
  TPU_ZONE             --zone              zone, e.g. us-east5-a (required)
  TPU_ACCELERATOR      --accelerator       v5p-8 | v5litepod-16 | v6e-32 ... (default v5p-8)
  TPU_RUNTIME_VERSION  --runtime-version   default from the accelerator: v5p-* v2-alpha-tpuv5,
                                           v5litepod-* v2-alpha-tpuv5-lite, v6e-* v2-alpha-tpuv6e
  TPU_NAME             --name              TPU VM (node) name (default adaflash)
  TPU_QR_ID            --qr-id             queued-resource id (default <name>-qr)
  TPU_BUCKET           --bucket            GCS bucket for runs, without gs://
  TPU_SPOT=1           --spot              Spot capacity (--preemptible is an alias)
  TPU_DRY_RUN=1        --dry-run           print the commands, run nothing"

die() {
  echo "error: $*" >&2
  exit 2
}

parse_flags() {
  local flag
  while (($#)); do
    flag="${1%%=*}"
    if [[ $1 == -h || $1 == --help ]]; then
      usage
      exit 0
    elif [[ $1 == -- ]]; then
      shift
      PASSTHRU_ARGS=("$@")
      return
    elif [[ -n ${SWITCH_VARS[$1]+set} ]]; then
      printf -v "${SWITCH_VARS[$1]}" '%s' 1
      shift
    elif [[ -n ${FLAG_VARS[$flag]+set} ]]; then
      if [[ $1 == *=* ]]; then
        printf -v "${FLAG_VARS[$flag]}" '%s' "${1#*=}"
        shift
      else
        (($# >= 2)) || die "$1 needs a value"
        printf -v "${FLAG_VARS[$flag]}" '%s' "$2"
        shift 2
      fi
    else
      die "unknown argument '$1' (see --help)"
    fi
  done
}

require() {  # require VAR FLAG
  [[ -n ${!1} ]] || die "set $1 or pass $2"
}

# Resolves defaults that depend on other settings; checks what every script needs.
finish_settings() {
  require TPU_PROJECT --project
  require TPU_ZONE --zone
  require TPU_NAME --name
  TPU_QR_ID="${TPU_QR_ID:-${TPU_NAME}-qr}"
  if [[ -z $TPU_RUNTIME_VERSION ]]; then
    # Google's TPU software versions for JAX (cloud.google.com/tpu/docs/runtimes).
    case "$TPU_ACCELERATOR" in
      v5litepod-*) TPU_RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
      v5p-*) TPU_RUNTIME_VERSION=v2-alpha-tpuv5 ;;
      v6e-*) TPU_RUNTIME_VERSION=v2-alpha-tpuv6e ;;
      *) die "no default runtime version for '$TPU_ACCELERATOR'; pass --runtime-version" ;;
    esac
  fi
  if [[ $TPU_DRY_RUN != 1 ]] && ! command -v gcloud >/dev/null; then
    die "gcloud not found: install the Google Cloud CLI (or use --dry-run)"
  fi
}

quote_arg() {  # --flag=value keeps the flag bare and quotes only the value
  local prefix="" value="$1"
  if [[ $value =~ ^(--[A-Za-z0-9-]+=)(.*)$ ]]; then
    prefix="${BASH_REMATCH[1]}"
    value="${BASH_REMATCH[2]}"
  fi
  if [[ $value =~ ^[A-Za-z0-9_./:=@%+,-]*$ ]]; then
    printf '%s%s' "$prefix" "$value"
  else
    printf "%s'%s'" "$prefix" "${value//\'/\'\\\'\'}"
  fi
}

command_line() {  # the command as one shell-quoted line
  local line="" arg
  for arg in "$@"; do
    line+="${line:+ }$(quote_arg "$arg")"
  done
  printf '%s' "$line"
}

run() {
  echo "+ $(command_line "$@")"
  if [[ $TPU_DRY_RUN != 1 ]]; then
    "$@"
  fi
}

# Location flags every gcloud TPU command takes.
location_flags() {
  LOCATION=(--project="$TPU_PROJECT" --zone="$TPU_ZONE")
}

tpu_ssh() {  # tpu_ssh WORKER REMOTE_COMMAND
  location_flags
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker="$1" --command="$2"
}
