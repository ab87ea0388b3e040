#!/usr/bin/env bash
# The hybrid models side by side with vLLM (docs/benchmarks.md): Qwen3.5-0.8B's shapes
# (built-in qwen3.5-0.8b-random, in /tmp/q35) and Gemma 3 4B's (benchmarks/gemma3_random.py, in
# /tmp/g34), random bfloat16 weights. On the GPU machine, project root, after the peers kit's
# device_setup.sh (vLLM in /tmp/vsite, its dependencies in /tmp/deps):
#   bash benchmarks/hybrid_sbs.sh SECTION [SECTION...]
#   prep     : flash-linear-attention (.cache/wheels, carried) and the client's wheels
#              (.cache/kitwheels: benchmarks/kit_wheels.sh, carried) into /tmp/deps; both
#              checkpoints; /tmp/vllm_client.sh stops waiting for a server that exited
# vLLM runs its Triton GDN prefill kernel (`gdn_prefill_backend: triton`): its default on Hopper
# is FlashInfer's, which the peers kit does not carry. VLLM_ARGS replaces that.
#   served35 / servedg3 : vllm_client.sh on Qwen3.5 / Gemma 3 (CONCS, default "16 64")
#   w1q35 / w1g3        : W1 offline (benchmarks/sbs.py, 512 requests, 128 tokens), vlmserve
#                         then vLLM (SBS_N, default 512; BS1=1 adds batch-1 decode)
#   mtq35 / mtg3        : multi-turn chat with images (benchmarks/multiturn_sbs.sh), both
# Results under $OUT.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export CONCS=${CONCS:-16 64}
gdn_triton='--additional-config {"gdn_prefill_backend":"triton"}'
export VLLM_ARGS=${VLLM_ARGS-$gdn_triton}
mkdir -p "$OUT"
w1() {  # w1 CKPT PROMPT
  for side in vlmserve vllm; do
    local path=$PWD:/tmp/deps; [ "$side" = vllm ] && path=/tmp/vsite:/tmp/deps
    SBS_PROMPT=$2 BS1=${BS1:-0} PYTHONPATH=$path timeout 420 python3 benchmarks/sbs.py "$side" \
      "$1" "${SBS_N:-512}" $( [ "$side" = vlmserve ] && echo max_num_seqs=512 \
      max_num_batched_tokens=16384 ) > "$OUT/w1_$(basename "$1")_$side.log" 2>&1
    grep RESULT "$OUT/w1_$(basename "$1")_$side.log" || tail -3 "$OUT/w1_$(basename "$1")_$side.log"
  done
}
for section in "$@"; do
  echo "=== $section"
  case $section in
    prep)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/deps \
        .cache/wheels/*.whl .cache/kitwheels/*.whl 2>&1 | grep -v WARNING
      sed -i 's|curl -sf "localhost:$1/health" >/dev/null \&\& return 0;|&'\
' kill -0 $pid 2>/dev/null \|\| return 1;|' /tmp/vllm_client.sh
      PYTHONPATH=$PWD:/tmp/deps python3 -c "
import torch; from vlmserve.models.builtin import create_checkpoint
create_checkpoint('qwen3.5-0.8b-random', '/tmp/q35', dtype=torch.bfloat16, device='cuda')"
      PYTHONPATH=$PWD:/tmp/deps python3 benchmarks/gemma3_random.py /tmp/g34 --device cuda \
        2>&1 | tail -1 ;;
    served35) bash /tmp/vllm_client.sh /tmp/q35 ;;
    servedg3) bash /tmp/vllm_client.sh /tmp/g34 ;;
    w1q35) w1 /tmp/q35 qwen ;;
    w1g3) w1 /tmp/g34 gemma ;;
    mtq35) bash benchmarks/multiturn_sbs.sh /tmp/q35 ;;
    mtg3) bash benchmarks/multiturn_sbs.sh /tmp/g34 ;;
    *) echo "unknown section $section" ;;
  esac
done
