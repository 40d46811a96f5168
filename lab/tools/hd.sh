#!/usr/bin/env bash
# GPU checks of padded head dims (issue 17, branch hd-headdims), one H100/H200, under 6 minutes:
#
#   OUT=/tmp/hd_out bash lab/tools/hd.sh        (from the tree root; $OUT defaults to /tmp/hd_out)
#
#   1. precompile what the tests use into OMNICUPY_CACHE_DIR=/tmp/oc_hd: the forward (stage 2, every
#      family the GPU has) for D = 8,40,80,136,160,192,248, the backward and decode for D = 40,80,192
#   2. tests/gpu/test_head_dims_gpu.py: forward D x {full, causal, document} x {fp16, bf16} x
#      {sync, wgmma, tma} (OMNICUPY_MMA; the plan's family and padding asserted), cross lengths + GQA +
#      strided views, no store past D, backward dq/dk/dv for D = 40/80/192, decode (1 and 3 splits),
#      paged (NHD/HND) and varlen for D = 40/80/192; float64 references, NaN-poisoned outputs, seeds logged
#   3. compute-sanitizer memcheck of tests/sanitize/sanitize_head_dims.py (one padded forward per family,
#      backward at D = 80 and 192, decode + combine at D = 40, paged at D = 192)
#   4. lab/tools/hd_time.py: causal fp16 forward time of D = 40/80/104/136/192 beside their tiles'
#      (64/96/128/256), N = 4096, B = 2, H = 16 (for lab/notes/head-dims.md#s13; kernels JIT-compiled on first use)
#   5. a summary table (last)
# Logs: $OUT/*.log.
OUT_DEFAULT=/tmp/hd_out LOG=hd.log
STEP_PATTERN='passed|failed|ERROR SUMMARY|WRONG|variants in'
STEP_TAIL=25
export OMNICUPY_CACHE_DIR=/tmp/oc_hd
source "$(dirname "$0")/steps.sh"

step precompile_fwd 120 "$PY" -m omnicupy precompile --head-dims 8,40,80,136,160,192,248 --ops forward --stages 2 \
  --jobs 16 --quiet
step precompile_bwd_decode 120 "$PY" -m omnicupy precompile --head-dims 40,80,192 --ops backward,decode --jobs 16 \
  --quiet
step pytest 200 "$PY" -m pytest -q -p no:cacheprovider --maxfail=40 -rfEs tests/gpu/test_head_dims_gpu.py
if [ -n "$SAN" ]; then
  step sanitize_memcheck 120 "$SAN" --tool memcheck --error-exitcode 99 "$PY" tests/sanitize/sanitize_head_dims.py
else
  SUMMARY+=("memcheck   skipped: no compute-sanitizer")
fi
step timing 150 "$PY" lab/tools/hd_time.py  # padded vs tile head dims
print_summary | tee "$OUT/summary.txt"
