#!/usr/bin/env bash
# One device run for task dec (issue 16): the ragged-prefill crash and decode speed. Run from the
# repository root on one H200; logs go to $OUT (default /tmp/dec_out); the summary comes last.
#
#   1 precompile   decode tiles + tuning candidates + D 64/128 forward variants (parallel)
#   2 repro        lab/tools/dec_prefill.py --preset full under CUDA_LAUNCH_BLOCKING=1: the bench's
#                  prefill calls one synchronized step at a time (mask, varlen first/recall/graph,
#                  padded batch at 16 and 32 heads = 1 and 2 GiB of q), families auto and wgmma;
#                  the last "STEP" line before a fault names the call
#   3 memcheck     the same steps at 1/8 size (--preset small) under compute-sanitizer memcheck
#                  (names the kernel and address of any out-of-bounds access)
#   3b memcheck2  tests/sanitize/sanitize_decode.py under memcheck: contiguous/paged/block-mask decode with the
#                  combine kernel and the fused combine
#   4 tests        tests/gpu/test_decode_gpu.py: every decode/paged/varlen case against float64, the
#                  new prefill-at-bench-size regression tests and the fused-combine tests
#   5 tune         lab/bench/tune_decode.py: decode candidates side by side (table last), Nq 1
#                  on the 9 cells (contiguous, paged 16/64), then Nq 16 on B 8/32 x 32k
OUT_DEFAULT=/tmp/dec_out LOG=dec.log
STEP_PATTERN='STEP .*(FAILED|WRONG)|passed|failed|ERROR SUMMARY|prefill reproducer:|precompiled|decode sanitize run'
STEP_TAIL=25 STEP_LINES=3
export OMNICUPY_CACHE_DIR=/tmp/oc_dec
source "$(dirname "$0")/steps.sh"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
step precompile 50 "$PY" lab/tools/dec_precompile.py
step repro 75 env CUDA_LAUNCH_BLOCKING=1 "$PY" lab/tools/dec_prefill.py --preset full --families auto,wgmma
if [ -n "$SAN" ]; then
  step memcheck 60 "$SAN" --tool memcheck --report-api-errors no --print-limit 20 "$PY" lab/tools/dec_prefill.py --preset small \
    --steps mask,varlen,varlen_recall,padded,padded_recall
  step memcheck2 45 "$SAN" --tool memcheck --report-api-errors no --print-limit 20 "$PY" tests/sanitize/sanitize_decode.py \
    --head-dims 128 --dtypes fp16
else
  SUMMARY+=("memcheck   skipped: no compute-sanitizer")
fi
step tests 110 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_decode_gpu.py
step tune 110 "$PY" lab/bench/tune_decode.py --reps 3 --json "$OUT/tune_decode.json"
step tune16 40 "$PY" lab/bench/tune_decode.py --reps 3 --nq 16 --cells 8:32768,32:32768 --paged '' --json "$OUT/tune_decode_nq16.json"

echo
echo "---- tune tables"
sed -n '/^decode tuning/,$p' "$OUT/tune.log" "$OUT/tune16.log"
echo "---- repro steps"
grep -E '^STEP' "$OUT/repro.log" | tail -n 40  # a step with no result line after its "..." faulted
print_summary
