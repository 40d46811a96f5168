#!/usr/bin/env bash
# GPU check of the mask builders (issue 13), one H200, about 2 minutes after the machine starts:
#
#   OUT=/tmp/masks_out bash lab/tools/masks.sh        (from the tree root; $OUT defaults to /tmp/masks_out)
#
#   1. precompile the mask kernels (omnicupy precompile --ops mask)
#   2. tests/gpu/test_mask_kernels_gpu.py: the builder kernels against their NumPy twins (kernels.EmulatedBackend),
#      hashes and pool order included
#   3. benchmarks/bench_masks.py at N = 8192 and 131072, the four built-in masks, CuPy path, with
#      --steps and the minor page faults of each row (lab/notes/masks.md#s19), JSON in $OUT/bench_masks.json
#   4. a summary table (last)
OUT_DEFAULT=/tmp/masks_out LOG=masks.log STEP_PATTERN='passed|failed|Error' STEP_TAIL=40
export OMNICUPY_CACHE_DIR=/tmp/oc_masks
source "$(dirname "$0")/steps.sh"

step precompile 60 "$PY" -m omnicupy precompile --ops mask --jobs 16 --quiet
step pytest_masks 90 "$PY" -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_mask_kernels_gpu.py
step bench_masks 120 "$PY" benchmarks/bench_masks.py --no-torch --sizes 8192 131072 \
  --masks causal sliding_window_1024 document interleaved --generic-max-n 0 --steps --out "$OUT/bench_masks.json"
print_summary
