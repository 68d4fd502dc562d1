#!/usr/bin/env bash
# The quick GPU check: one call on a lent GPU machine, at most 6 minutes in all on one H100, set-up included.
#
#   scripts/gpu_quick.sh OUT_DIR [--key value ...]      on the GPU machine; --key value flags override
#                                                       recipes/ocr.yaml for the timed SD3.5-M step and its plan
#   scripts/gpu_quick.sh --dry-run OUT_DIR [...]        anywhere: set-up, validation, budget and report, no CUDA work
#   scripts/gpu_quick.sh OUT_DIR --only sd35m_step plan_vs_measured      a selection (names or group prefixes)
#
# Budget: 360 s. This script's set-up, installing the carried wheels, is allowed 20 s; then, each in its own process
# with its own time limit (a check over its limit is terminated, reported, and the next one starts): setup/wheels
# 15 s, bf16_onpolicy 30 s, sd35m_step 100 s (its step, then its training phase at train_timesteps_per_pass 1 and
# all), plan_vs_measured 20 s, nft_step 95 s, launch/fsdp8 60 s, 2 s of kill grace each; the report 5 s. flowgrpo.gpu_check.quick holds the limits (QUICK_CHECKS) and checks that they fit
# (tests/tooling/test_gpu_quick.py too); it also cuts a limit to the time left, counted from this script's start.
# Not in the default run: sd35m_compile 150 s (torch_compile on the same step), for a second call:
#   scripts/gpu_quick.sh OUT_DIR --only sd35m_step sd35m_compile      compile off against on (264 s of limits)
#
# Set-up: the wheels in .whl/ (`make gpu-wheels`; FLOWGRPO_WHEEL_DIR names another folder) are installed offline,
# without dependencies, into a new temporary folder that goes first on PYTHONPATH, with this tree's src/ after it:
# flowgrpo is imported from the working tree, not installed. Writes OUT_DIR/gpu_report.md, OUT_DIR/gpu_report.json and
# OUT_DIR/gpu_quick_logs.txt; the checks' files and the launch model go to FLOWGRPO_QUICK_WORK
# (default $TMPDIR/flowgrpo-quick). Exit status: 0 all passed, 1 a check failed (no wheels to install is a failed
# setup/wheels: the report is still written), 2 bad input.
set -uo pipefail

started=$(date +%s.%N 2>/dev/null || date +%s)
usage="usage: scripts/gpu_quick.sh [--dry-run] OUT_DIR [--only NAME ...] [--key value ...]"
dry_run=()
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=(--dry-run)
  shift
fi
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "$usage" >&2
  exit 2
fi
out=$1
shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
wheels=${FLOWGRPO_WHEEL_DIR:-$repo/.whl}
[ -d "$wheels" ] && wheels=$(cd "$wheels" && pwd)
tmp=${TMPDIR:-/tmp}
work=${FLOWGRPO_QUICK_WORK:-$tmp/flowgrpo-quick}
mkdir -p "$work" "$out" || exit 2
out=$(cd "$out" && pwd) || exit 2          # absolute: the checks run from the repository root

# A set-up problem does not stop the run: it is written into the report (setup/wheels fails with it), so that the
# report always comes back.
setup_error=""
shopt -s nullglob
files=("$wheels"/*.whl)
shopt -u nullglob
site=$(mktemp -d "$tmp/flowgrpo-site.XXXXXX") || exit 2
: >"$work/setup.log"
if [ ${#files[@]} -eq 0 ]; then
  setup_error="no wheels in $wheels: run 'make gpu-wheels' before the call and send .whl along with the working tree"
else
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  # The tags are the GPU machine's (CPython 3.12, manylinux x86-64), so that the same install also runs in a dry run
  # on another interpreter.
  if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
      "${platforms[@]}" "${files[@]}" >>"$work/setup.log" 2>&1; then
    echo "[gpu-quick] ${#files[@]} wheels installed into $site" | tee -a "$work/setup.log"
    printf '  %s\n' "${files[@]##*/}" >>"$work/setup.log"
  else
    setup_error="installing the wheels of $wheels into $site failed: $(tail -n 3 "$work/setup.log" | tr '\n' ' ')"
  fi
fi
if [ -n "$setup_error" ]; then
  echo "gpu-quick: error: $setup_error" | tee -a "$work/setup.log" >&2
fi

export PYTHONPATH="$site:$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export FLOWGRPO_QUICK_SITE=$site FLOWGRPO_QUICK_SETUP_ERROR=$setup_error
export FLOWGRPO_QUICK_COMMAND="scripts/gpu_quick.sh ${dry_run[*]:+${dry_run[*]} }$out${*:+ $*}"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
cd "$repo" || exit 2
exec "$python" -m flowgrpo.gpu_check.quick "$out" ${dry_run[@]+"${dry_run[@]}"} --site "$site" --work "$work" \
  --started-at "$started" "$@"
