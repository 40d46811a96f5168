#!/usr/bin/env bash
# GPU check of branch decode-clean (issue 16: affine rows removed, decode tunables in the
# steady-state keys, one RecipeStore, the decode's first call through a Launcher). Run from the
# repository root on one H200 (CUDA 13, cupy-cuda13x), within 300 s; logs go to $OUT (default
# /tmp/decode_check); the summary table comes last.
#
#   bash lab/tools/decode_check.sh
#
#   1 precompile  the shipped decode + combine variants for this GPU's arch (omnicupy precompile)
#   2 tests       the decode/paged/varlen and host-path GPU tests (test_decode_gpu.py,
#                 test_host_path_gpu.py: every case against float64, steady-state replays)
#   3 memcheck    tests/sanitize/sanitize_decode.py under compute-sanitizer memcheck: contiguous (combine
#                 kernel and fused combine), paged 16 NHD / 64 HND, block mask; D 128 fp16
#   4 tune        lab/bench/tune_decode.py, quick: the shipped kernel (fused combine) on the
#                 contiguous cache and on pages of 16, B 1/8/32 x 8k/32k/128k, K+V TB/s table
OUT_DEFAULT=/tmp/decode_check LOG=decode_check.log
STEP_PATTERN='passed|failed|error|ERROR SUMMARY|decode sanitize run|compiled|variants'
export OMNICUPY_CACHE_DIR=${OMNICUPY_CACHE_DIR:-/tmp/oc_decode_check}
source "$(dirname "$0")/steps.sh"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" \
  >> "$OUT/gpu.txt" 2>&1
git log --oneline -1 >> "$OUT/gpu.txt" 2>&1

step precompile 35 "$PY" -m omnicupy precompile --ops decode --dtypes fp16,bf16 --jobs 16 --quiet
step tests 130 "$PY" -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_decode_gpu.py tests/gpu/test_host_path_gpu.py
if [ -n "$SAN" ]; then
  step memcheck 45 "$SAN" --tool memcheck --report-api-errors no --print-limit 20 "$PY" tests/sanitize/sanitize_decode.py \
    --head-dims 128 --dtypes fp16
else
  SUMMARY+=("memcheck   skipped: no compute-sanitizer")
fi
step tune 80 "$PY" lab/bench/tune_decode.py --candidates fused --paged 16 --paged-candidates fused --reps 2 \
  --json "$OUT/tune_decode.json"

echo
echo "---- tune table (K+V TB/s; fused = the shipped kernel, /ps16 = pages of 16)"
sed -n '/^decode tuning/,$p' "$OUT/tune.log"
echo "---- gpu"
cat "$OUT/gpu.txt"
print_summary
