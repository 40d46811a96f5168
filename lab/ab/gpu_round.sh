#!/usr/bin/env bash
# One verification round on a 4-GPU H200 machine, in one device call (about 9 minutes):
#   1. the distributed tests on 2 and 4 GPUs (they need every GPU);
#   2. the one-GPU suites and the sanitizers side by side, one group per GPU.
# Logs (one file per group) come back as $OUT/round.tgz; a short table is printed last.
#   bash lab/ab/gpu_round.sh [phase: all | dist | single]
set -u
phase=${1:-all}
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMNICUPY_CACHE_DIR=${OMNICUPY_CACHE_DIR:-/tmp/occ} XLA_PYTHON_CLIENT_PREALLOCATE=false
FINAL=${OUT:-/tmp/out}
OUT=/tmp/round_logs  # the device tool returns at most 8 files: everything goes into one archive
mkdir -p "$OUT" "$FINAL"
nvidia-smi -L > "$OUT/devices.txt"
python -m omnicupy precompile -j 48 > "$OUT/precompile.log" 2>&1 || true

run() {  # run NAME GPU TIMEOUT COMMAND...: one group on one GPU, its log in $OUT/NAME.log
  local name=$1 gpu=$2 limit=$3; shift 3
  (CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/rc.txt") &
}
san() {  # san TOOL SCRIPT ARGS...: compute-sanitizer, errors summarised in the log
  compute-sanitizer --tool "$1" --report-api-errors no --print-limit 20 python3 "${@:2}"
}

if [ "$phase" != single ]; then
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_distributed_gpu.py > "$OUT/dist.log" 2>&1
  echo "dist rc=$?" >> "$OUT/rc.txt"
fi
if [ "$phase" != dist ]; then
  run fwd 0 420 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_attention_gpu.py \
    tests/gpu/test_features_gpu.py tests/gpu/test_inputs_gpu.py tests/gpu/test_tma_gpu.py
  run bwd 1 420 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_backward_gpu.py \
    tests/gpu/test_backward_wgmma_gpu.py
  run rest 2 420 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_decode_gpu.py \
    tests/gpu/test_head_dims_gpu.py tests/gpu/test_host_path_gpu.py tests/gpu/test_mask_kernels_gpu.py \
    tests/gpu/test_compile_mask_gpu.py tests/gpu/test_torch_adapter_gpu.py tests/gpu/test_jax_adapter_gpu.py \
    tests/cpu/test_hardening.py
  (
    export CUDA_VISIBLE_DEVICES=3
    for tool in memcheck racecheck synccheck; do
      timeout 150 bash -c "$(declare -f san); san $tool tests/sanitize/sanitize_variants.py --families sync,wgmma,tma \
        --head-dims 64,128 --n 133" > "$OUT/san_fwd_$tool.log" 2>&1
      echo "san_fwd_$tool rc=$?" >> "$OUT/rc.txt"
    done
    for tool in memcheck racecheck; do
      timeout 60 bash -c "$(declare -f san); san $tool tests/sanitize/sanitize_backward.py --family wgmma \
        --head-dims 64 --dtypes fp16 --n 133" > "$OUT/san_bwd_$tool.log" 2>&1
      echo "san_bwd_$tool rc=$?" >> "$OUT/rc.txt"
    done
    timeout 40 bash -c "$(declare -f san); san memcheck tests/sanitize/sanitize_decode.py --head-dims 128 --dtypes fp16" \
      > "$OUT/san_dec_memcheck.log" 2>&1
    echo "san_dec_memcheck rc=$?" >> "$OUT/rc.txt"
  ) &
  wait
fi
echo "== results"
cat "$OUT/rc.txt"
for f in "$OUT"/*.log; do
  printf '%-22s %s\n' "$(basename "$f" .log)" \
    "$(grep -E '[0-9]+ (passed|failed)|ERROR SUMMARY|RACECHECK SUMMARY|^[0-9]+ kernels|exit' "$f" | tail -1 | cut -c1-110)"
done
tar czf "$FINAL/round.tgz" -C "$OUT" .
