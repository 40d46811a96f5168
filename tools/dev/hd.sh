#!/usr/bin/env bash
# GPU checks of padded head dims (issue 17, branch hd-headdims), one H100/H200, under 6 minutes:
#
#   OUT=/tmp/hd_out bash tools/dev/hd.sh        (from the tree root; $OUT defaults to /tmp/hd_out)
#
#   1. precompile what the tests use into OMNICUPY_CACHE_DIR=/tmp/oc_hd: the forward (stage 2, every
#      family the GPU has) for D = 8,40,80,136,160,192,248, the backward and decode for D = 40,80,192
#   2. tests/test_head_dims_gpu.py: forward D x {full, causal, document} x {fp16, bf16} x
#      {sync, wgmma, tma} (OMNICUPY_MMA; the plan's family and padding asserted), cross lengths + GQA +
#      strided views, no store past D, backward dq/dk/dv for D = 40/80/192, decode (1 and 3 splits),
#      paged (NHD/HND) and varlen for D = 40/80/192; float64 references, NaN-poisoned outputs, seeds logged
#   3. compute-sanitizer memcheck of tests/sanitize_head_dims.py (one padded forward per family,
#      backward at D = 80 and 192, decode + combine at D = 40, paged at D = 192)
#   4. tools/dev/hd_time.py: causal fp16 forward time of D = 40/80/104/136/192 beside their tiles'
#      (64/96/128/256), N = 4096, B = 2, H = 16 (for NOTES.md §13; kernels JIT-compiled on first use)
#   5. a summary table (last)
# Logs: $OUT/*.log.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
export OMNICUPY_CACHE_DIR=/tmp/oc_hd
OUT=${OUT:-/tmp/hd_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
declare -A RC

echo "[$(elapsed)s] precompile"
$PY -m omnicupy precompile --head-dims 8,40,80,136,160,192,248 --ops forward --stages 2 --jobs 16 --quiet \
  >"$OUT/precompile.log" 2>&1
RC[precompile_fwd]=$?
$PY -m omnicupy precompile --head-dims 40,80,192 --ops backward,decode --jobs 16 --quiet >>"$OUT/precompile.log" 2>&1
RC[precompile_bwd_decode]=$?
tail -4 "$OUT/precompile.log"

echo "[$(elapsed)s] GPU tests"
timeout 200 $PY -m pytest -q -p no:cacheprovider --maxfail=40 -rfEs tests/test_head_dims_gpu.py \
  >"$OUT/pytest.log" 2>&1
RC[pytest]=$?
tail -25 "$OUT/pytest.log"

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "[$(elapsed)s] compute-sanitizer memcheck ($SANITIZER)"
if [ -n "$SANITIZER" ]; then
  timeout 120 "$SANITIZER" --tool memcheck --error-exitcode 99 $PY tests/sanitize_head_dims.py \
    >"$OUT/sanitize_memcheck.log" 2>&1
  RC[memcheck]=$?
  grep -E "ERROR SUMMARY|WRONG|ok |seed|Error" "$OUT/sanitize_memcheck.log" | tail -16
else
  echo "compute-sanitizer not found" | tee "$OUT/sanitize_memcheck.log"
  RC[memcheck]=127
fi

echo "[$(elapsed)s] timing (padded vs tile head dims)"
timeout 150 $PY tools/dev/hd_time.py >"$OUT/time.log" 2>&1
RC[timing]=$?
cat "$OUT/time.log" | tail -7

echo "[$(elapsed)s] summary"
{
  printf "%-24s %s\n" "step" "exit code (0 = pass)"
  for step in precompile_fwd precompile_bwd_decode pytest memcheck timing; do
    printf "%-24s %s\n" "$step" "${RC[$step]}"
  done
  printf "%-24s %s\n" "pytest" "$(grep -E '^[0-9]+ (passed|failed)|[0-9]+ passed|[0-9]+ failed' "$OUT/pytest.log" | tail -1)"
  printf "%-24s %s\n" "memcheck" "$(grep -E 'ERROR SUMMARY' "$OUT/sanitize_memcheck.log" | tail -1) $(grep -cE '^WRONG' "$OUT/sanitize_memcheck.log") wrong"
  printf "%-24s %ss\n" "elapsed" "$(elapsed)"
} | tee "$OUT/summary.txt"
