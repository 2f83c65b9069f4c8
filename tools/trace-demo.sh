#!/usr/bin/env bash
# On the GPU machine, after tools/gpu-suite.sh built everything in build-gpu: records a real
# allocation trace (PyTorch training with its caching allocator off, so every tensor is a
# cudaMalloc/cudaFree served by the hook), with the stats table, the JSON stats and the leak
# report; replays the trace against native cudaMalloc, cudaMallocAsync and the hook; plots it.
# Everything lands in $OUT: torch-trace.csv, torch-trace.png, trace-demo.txt.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:?set OUT}
B=${GPU_SUITE_BUILD:-build-gpu}
lib=$PWD/$B/src/libvmmhook.so
replay=$B/tools/replay/replay
log=$OUT/trace-demo.txt
{
  echo "== torch_train nocache under the hook, VMMHOOK_TRACE + STATS + LEAKS"
  rm -f "$OUT/torch-trace.csv"
  env LD_PRELOAD="$lib" VMMHOOK_TRACE="$OUT/torch-trace.csv" VMMHOOK_STATS=1 VMMHOOK_LEAKS=1 \
      VMMHOOK_STATS_JSON="$OUT/torch-stats.json" PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      timeout 120 python3 tests/gpu/torch_train.py nocache 20 2>&1 | grep -v '^R step'
  echo "trace file: $(wc -l < "$OUT/torch-trace.csv") lines, mode $(stat -c %a "$OUT/torch-trace.csv")"
  head -3 "$OUT/torch-trace.csv"
  echo "== stats JSON"; head -c 1500 "$OUT/torch-stats.json"; echo
  echo "== replay: native and cudaMallocAsync"
  timeout 120 "$replay" --repeat 3 "$OUT/torch-trace.csv" 2>&1 | tail -15
  echo "== replay: under the hook"
  env LD_PRELOAD="$lib" timeout 120 "$replay" --repeat 3 --impl native "$OUT/torch-trace.csv" 2>&1 | tail -8
  echo "== plot"
  python3 tools/replay/plot-trace.py "$OUT/torch-trace.csv" -o "$OUT/torch-trace.png" 2>&1 | tail -3
} >"$log" 2>&1
rm -f "$OUT/torch-stats.json"
cat "$log"
