#!/usr/bin/env bash
# Second device call: Triton kernels and CUDA graphs checked, then the speed numbers with them.
set -u
export VLMSERVE_CACHE=/tmp/vlmcache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {
  local name=$1 secs=$2; shift 2
  echo "=== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "rc=$rc" >> "$OUT/$name.log"
  grep -v "it/s\]\|s/it\]" "$OUT/$name.log" | tail -n "${TAIL:-6}"
  return $rc
}
step graphs 75 python -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_cuda_graphs.py
step kernels_subset 60 python -m pytest -q -p no:cacheprovider -o addopts="" -x \
  tests/gpu/test_triton_attention.py -k "bf16 and bs16"
step speed_triton 90 python -m vlmserve.benchmarks.model_speed --model qwen2-vl-2b-random \
  --num-requests 128 --decode-batches 1,64 --attention-backend triton --out "$OUT/speed_triton.json"
step throughput_triton 75 python -m vlmserve.benchmarks.throughput --model qwen2-vl-2b-random \
  --num-requests 64 --image-sizes 448,672,896 --prompt-len 50 --output-len 128 \
  --backend vlmserve --max-num-seqs 64 --attention-backend triton --out "$OUT/throughput_triton.json"
