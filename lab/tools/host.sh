#!/usr/bin/env bash
# lab/tools/host.sh - the host path on one H200 (issue 13), in one run of under 6 minutes:
#   1. precompile the forward, backward and decode kernels the run needs (fp16, D = 128) into /tmp/oc_host
#   2. GPU tests of the host path: tests/gpu/test_host_path_gpu.py (cached calls = first calls for the forward,
#      backward, decode-shaped attention and paged_attention(validate=False); no synchronization, proved
#      with a spinning kernel ahead in the stream; graph capture and replay incl. a never-used GPU-built
#      mask, the backward and decode steps with new device kv_lens; launch routes agree; threads share a
#      recipe; a refused launch is a LaunchError; torch tensors) plus the CPU tests of the same code
#   3. benchmarks/bench_overhead.py: host µs per call, forward and backward, CuPy and torch inputs, each
#      launch route, a decode step (attention with device kv_lens; paged_attention validate=False), SDPA and
#      flex (N = 1024 only: it compiles per N) side by side, direct vs
#      graph-replayed GPU µs (N = 512, 1024, 4096)
#   4. benchmarks/bench_masks.py: built-in masks at N = 8192 and 131072, from_dense (random_50/10) at 8192,
#      next to torch's create_block_mask
#   5. cold start: a fresh OMNICUPY_CACHE_DIR and CUPY_CACHE_DIR, `omnicupy precompile --ops mask`, then a NEW
#      process timing its first BlockMask builds (benchmarks/bench_first_build.py); then a second fresh pair
#      of folders and a new process without precompile
# Logs under $OUT (default /tmp/host_out); the summary table is printed last.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
export OMNICUPY_CACHE_DIR=/tmp/oc_host
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/host_out}
mkdir -p "$OUT"
SUMMARY=()
T_START=$(date +%s)

step() {  # step NAME TIMEOUT_S command...: runs it with its output in $OUT/NAME.log, records rc and seconds
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local spent=$(( $(date +%s) - t0 ))
    SUMMARY+=("| $name | $rc | $spent |")
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
}

# `omnicupy precompile` from this tree (the console script may belong to another install)
PRECOMPILE=($PY -c "import sys; from omnicupy.cli import main; sys.exit(main(sys.argv[1:]))" precompile --quiet)

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1 || true

# 1. kernels of steps 2 and 3 (the tests compile their few bias / expression variants themselves)
step precompile 200 "${PRECOMPILE[@]}" --cache-dir /tmp/oc_host --ops forward,backward,decode --head-dims 128 \
    --dtypes fp16 --stages 2 -j 16

# 2. tests
step gpu_tests 180 $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_host_path_gpu.py tests/cpu/test_launch.py \
    tests/cpu/test_recall.py tests/cpu/test_bench_overhead.py

# 3. host time per call
step overhead 170 $PY benchmarks/bench_overhead.py --seq-lens 512,1024,4096 --flex-seq-lens 1024 --calls 200

# 4. mask builds
step masks 120 $PY benchmarks/bench_masks.py --sizes 8192 131072 --repeat 5 --generic-max-n 8192 \
    --masks causal sliding_window_1024 document interleaved random_50 random_10 --out "$OUT/bench_masks.json"

# 5. cold start: fresh omnicupy and CuPy caches, with and without `omnicupy precompile --ops mask`
COLD=/tmp/oc_host_cold.$$
rm -rf "$COLD"; mkdir -p "$COLD"
step cold_precompile_mask 90 env CUPY_CACHE_DIR="$COLD/cupy_pre" "${PRECOMPILE[@]}" --cache-dir "$COLD/oc_pre" --ops mask
step cold_first_after_precompile 90 env OMNICUPY_CACHE_DIR="$COLD/oc_pre" CUPY_CACHE_DIR="$COLD/cupy_pre" \
    $PY benchmarks/bench_first_build.py --label "after precompile --ops mask" --json
step cold_first_no_precompile 120 env OMNICUPY_CACHE_DIR="$COLD/oc_none" CUPY_CACHE_DIR="$COLD/cupy_none" \
    $PY benchmarks/bench_first_build.py --label "no precompile" --json
rm -rf "$COLD"

echo
echo "#################### results"
cat "$OUT/gpu.txt"
echo "--- tests"; grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 1
echo "--- host path (bench_overhead)"; sed -n '/^| host path piece/,$p' "$OUT/overhead.log"
echo "--- mask builds (bench_masks)"; sed -n '/^mask  /,/^$/p' "$OUT/masks.log"
for f in cold_first_after_precompile cold_first_no_precompile; do
    echo "--- $f"; sed -n '/^first builds/,/^{/p' "$OUT/$f.log" | grep -v '^{'
    grep -E "^\[omnicupy" "$OUT/$f.log" | head -n 5
done
echo
echo "#################### summary (rc 124: step hit its time limit; logs in $OUT)"
echo "| step | rc | s |"
echo "| --- | ---: | ---: |"
printf '%s\n' "${SUMMARY[@]}"
echo "| total | | $(( $(date +%s) - T_START )) |"
