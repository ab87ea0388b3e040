#!/usr/bin/env bash
# Multi-turn chat with images, side by side: `vlmserve serve` then vLLM's OpenAI server on the
# same checkpoint and machine, each measured by vlmserve.benchmarks.multiturn (TTFT of turn 1 and
# of turns 2 and up, where the prefix cache answers). On the GPU machine, project root, after the
# peers' device_setup.sh (vLLM in /tmp/vsite, its dependencies in /tmp/deps):
#   bash benchmarks/multiturn_sbs.sh CKPT [ours|vllm|both]
# MT_ARGS replaces the benchmark's arguments (default: 32 conversations of 4 turns, 2 images in
# the first, 64 output tokens); VLMSERVE_ARGS / VLLM_ARGS add server flags. A first pass of 8
# conversations warms each server. Results: $OUT/multiturn/{vlmserve,vllm}.json.
set -u
ck=$1; side=${2:-both}
ARGS=${MT_ARGS:---conversations 32 --turns 4 --images 2 --output-len 64}
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
dir=$OUT/multiturn; mkdir -p "$dir"
up() { for _ in $(seq 1 400); do curl -sf "localhost:$1/health" >/dev/null && return 0; kill -0 $pid 2>/dev/null || return 1; sleep 1; done; return 1; }
bench() {  # bench PORT TAG
  PYTHONPATH=$PWD:/tmp/deps python3 -m vlmserve.benchmarks.multiturn \
    --base-url "http://127.0.0.1:$1" --conversations 8 --turns 2 --seed 99 > /dev/null
  PYTHONPATH=$PWD:/tmp/deps python3 -m vlmserve.benchmarks.multiturn \
    --base-url "http://127.0.0.1:$1" $ARGS --out "$dir/$2.json" | sed "s/^/$2 /"
}
if [ "$side" != vllm ]; then
  PYTHONPATH=$PWD:/tmp/deps python3 -m vlmserve serve "$ck" --port 8001 --served-model-name m \
    --max-model-len 8192 ${VLMSERVE_ARGS:-} > "$dir/vlmserve_server.log" 2>&1 &
  pid=$!; if up 8001; then bench 8001 vlmserve; else echo "vlmserve did not come up"; tail -5 "$dir/vlmserve_server.log"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
fi
if [ "$side" != ours ]; then
  PYTHONPATH=/tmp/vsite:/tmp/deps python3 -m vllm.entrypoints.openai.api_server --model "$ck" \
    --port 8002 --served-model-name m --max-model-len 8192 --enable-prefix-caching \
    --limit-mm-per-prompt '{"image":4}' ${VLLM_ARGS:-} > "$dir/vllm_server.log" 2>&1 &
  pid=$!; if up 8002; then bench 8002 vllm; else echo "vLLM did not come up"; tail -5 "$dir/vllm_server.log"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
fi
