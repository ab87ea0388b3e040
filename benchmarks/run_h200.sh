#!/usr/bin/env bash
# Everything we measure on the H200 in one device call (the device budget is 30 min a session).
# Usage (device tool, repo root): bash benchmarks/run_h200.sh   -> logs and JSON under $OUT
set -u
export VLMSERVE_CACHE=/tmp/vlmcache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "rc=$rc" >> "$OUT/$name.log"
  grep -v "it/s\]\|s/it\]" "$OUT/$name.log" | tail -n "${TAIL:-6}"
  return $rc
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# kernels and CUDA graphs first: if they fail, the benchmarks fall back to the torch backend
if step gpu_tests 100 python -m pytest -q -p no:cacheprovider -x tests/gpu -k "not varlen"; then
  FAST=(--attention-backend auto)
else
  FAST=(--attention-backend torch)
fi
step throughput_w1 150 python -m vlmserve.benchmarks.throughput --model qwen2-vl-2b-random \
  --num-requests 64 --image-sizes 448,672,896 --prompt-len 50 --output-len 128 \
  --backend both --hf-batch-size 64 --max-num-seqs 64 "${FAST[@]}" --out "$OUT/throughput.json"
step offload 220 python -m vlmserve.benchmarks.offload --model qwen2-vl-2b-random \
  --num-requests 64 --images-per-request 4 --image-size 1344 --max-num-batched-tokens 2048 \
  --output-len 64 --kv-blocks 40000 "${FAST[@]}" --out "$OUT/offload.json"
step speed 100 python -m vlmserve.benchmarks.model_speed --model qwen2-vl-2b-random \
  --num-requests 128 --decode-batches 1,64 "${FAST[@]}" --out "$OUT/speed.json"
