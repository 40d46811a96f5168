# lab/tools/steps.sh - sourced by the GPU check scripts here (bw.sh, dec.sh, decode_check.sh, hd.sh):
# the common set-up and the step runner. Before sourcing, set OUT_DEFAULT (the log folder unless $OUT is set),
# LOG (the combined log's file name in it) and STEP_PATTERN (a grep -E of the lines a step's summary
# row quotes); STEP_TAIL (lines echoed after a step, default 15) and STEP_LINES (summary lines kept,
# default 2) are optional. Gives PY, SAN (compute-sanitizer, or empty), OUT, SUMMARY, T0,
# `step NAME SECONDS command...` and `print_summary`.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=.
OUT=${OUT:-$OUT_DEFAULT}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
SUMMARY=()
T0=$(date +%s)

step() {  # step NAME SECONDS command...: output in $OUT/NAME.log, its tail echoed, a summary row kept
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/$LOG"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n "${STEP_TAIL:-15}" "$OUT/$name.log" | tee -a "$OUT/$LOG"
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - start ))" \
    "$(grep -E "$STEP_PATTERN" "$OUT/$name.log" | tail -n "${STEP_LINES:-2}" | tr '\n' ' ' | cut -c1-200)")")
}

print_summary() {
  echo "---- summary (logs in $OUT; $(( $(date +%s) - T0 )) s in all)"
  printf '%s\n' "${SUMMARY[@]}"
}
