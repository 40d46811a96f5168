#!/usr/bin/env bash
# GPU checks of the wgmma backward (issue 14, branch bw-wgmma), one H200, under 6 minutes:
#
#   OUT=/tmp/bw_out bash lab/tools/bw.sh        (from the tree root; $OUT defaults to /tmp/bw_out)
#
#   1. precompile the forward and backward variants (sm_90, stage 2) into OMNICUPY_CACHE_DIR=/tmp/oc_bw
#   2. tests/gpu/test_backward_wgmma_gpu.py: every case of test_backward_gpu.py under OMNICUPY_BWD=wgmma
#      (full feature table: block types, causal variants, fused masks, bias, score mods, GQA,
#      Nq != Nkv, odd lengths, fp16/bf16, deterministic bitwise repeat) plus tile-edge lengths at
#      D = 64/128 and a check that the wgmma kernels ran
#   3. compute-sanitizer memcheck and racecheck on tests/sanitize/sanitize_backward.py --family wgmma (small N)
#   4. benchmarks.run --pass bwd, fp16, N = 8192, B = 2, H = 16, D = 64/128: full, causal, document,
#      OMNICUPY_BWD=sync then wgmma, gradients checked against float64 first; then
#      lab/bench/tune_backward.py --family wgmma: tiles 64x64 (1 warpgroup) vs 64x128 (2, D = 128),
#      deterministic=True, full and causal
#   5. a summary table (last)
# Each step has a timeout (150 + 2x35 + 2x60 + 50 s after a ~20 s precompile: worst case ~7 min,
# expected well under 6).
# Logs: $OUT/*.log; benchmark JSON: $OUT/bench_{sync,wgmma}/results.json.
OUT_DEFAULT=/tmp/bw_out LOG=bw.log
STEP_PATTERN='passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|WRONG|Error|TFLOP/s'
export OMNICUPY_CACHE_DIR=/tmp/oc_bw
source "$(dirname "$0")/steps.sh"

step precompile 60 "$PY" -m omnicupy precompile --ops forward,backward --stages 2 --arch sm_90 --jobs 16 --quiet
step pytest_wgmma 150 "$PY" -m pytest -q -p no:cacheprovider --maxfail=40 -rfE tests/gpu/test_backward_wgmma_gpu.py
for tool in memcheck racecheck; do
  if [ -n "$SAN" ]; then
    step "sanitize_$tool" 35 "$SAN" --tool "$tool" --error-exitcode 99 "$PY" tests/sanitize/sanitize_backward.py \
      --family wgmma --head-dims 64,128 --dtypes fp16 --n 133
  else
    SUMMARY+=("sanitize_$tool skipped: no compute-sanitizer")
  fi
done
for family in sync wgmma; do
  step "bench_$family" 60 env OMNICUPY_BWD=$family "$PY" -m benchmarks.run --pass bwd --budget 35 \
    --masks full,causal,document --head-dims 64,128 --dtypes fp16 --seq-lens 8192 --systems omnicupy --warmup 5 \
    --rep 20 --no-chart --out "$OUT/bench_$family"
done
# wgmma tiles at D = 128 (one consumer warpgroup 64x64 vs two, 64x128) and deterministic=True,
# gradients of one head checked against float64 first
step tune_wgmma 50 "$PY" lab/bench/tune_backward.py --family wgmma --head-dims 64,128 --masks full,causal \
  --tiles 64:64:4,64:128:8 --det --precompile 16

$PY - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(family):
    path = out / f"bench_{family}" / "results.json"
    if not path.exists():
        return {}
    return {(r["system"], r["mask"], r["head_dim"]): r for r in json.loads(path.read_text())["rows"]}

sync, wg = rows("sync"), rows("wgmma")
print("\nbackward TFLOP/s (fp16, B=2, H=16, N=8192; 2.5x the forward's count); None = not timed or WRONG")
print(f"| {'system':13} | {'mask':8} | {'D':>3} | {'sync':>7} | {'wgmma':>7} | {'wgmma/sync':>10} |")
print(f"| {'-'*13} | {'-'*8} | {'-'*3}: | {'-'*7}: | {'-'*7}: | {'-'*10}: |")
for key in sorted(set(sync) | set(wg), key=lambda k: (k[0], k[2], k[1])):
    a, b = sync.get(key, {}).get("tflops"), wg.get(key, {}).get("tflops")
    ratio = f"{b / a:.2f}" if a and b else "-"
    print(f"| {key[0]:13} | {key[1]:8} | {key[2]:>3} | {a or 'None':>7} | {b or 'None':>7} | {ratio:>10} |")
log = (out / "pytest_wgmma.log").read_text() if (out / "pytest_wgmma.log").exists() else ""
counts = re.findall(r"(\d+ (?:passed|failed|skipped|error|errors))", log)
print(f"\nwgmma GPU tests: {', '.join(counts[-4:]) or 'no summary (see pytest_wgmma.log)'}")
tune = out / "tune_wgmma.log"
if tune.exists():
    print("\nwgmma tiles / deterministic (tune_backward.py):")
    for line in tune.read_text().splitlines():
        if "TFLOP/s" in line or "Error" in line:
            print("  " + line)
for tool in ("memcheck", "racecheck"):
    p = out / f"sanitize_{tool}.log"
    text = p.read_text() if p.exists() else ""
    summary = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: .*", text)
    wrong = text.count("WRONG")
    print(f"{tool}: {summary[-1] if summary else 'no summary'}; {wrong} wrong gradients")
EOF
print_summary
