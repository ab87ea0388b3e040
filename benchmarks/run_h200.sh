#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md by section; several sections may share one
# device call when they fit its 10-minute limit. Usage (device tool, repo root):
#   bash benchmarks/run_h200.sh SECTION [SECTION...]
#   checks  : GPU tests (Triton kernels and fused ops, CUDA graphs, offload streams), CUDA parity
#   tpcuda  : (2+ GPUs) TP=2 on NCCL vs one GPU for each vision mode, offload on
#   quick   : fused ops, CUDA graphs and vision kernel tests, and the image processing parity
#             with HF (torchvision backend there)
#   speed   : 2B decode vs floor with kernel profile, vision batch, prefill chunk, prefill+vision
#   vision  : the same with the Triton varlen kernel in the vision tower
#   final   : CUDA graph tests, 2B and 7B decode (one short call)
#   decode  : 2B decode at batch 1, 64, 256 and 7B at batch 1 (no tests)
#   all     : quick, speed, decode, W1 throughput, in one call (~8 minutes)
#   speed7b : Qwen2.5-VL-7B decode at batch 1 vs floor
#   w1      : W1 throughput, 512 requests, ours (512 running, 16,384 tokens a step) vs
#             transformers generate
#   w1ours  : W1 with our engine only (no transformers run)
#   w1diag  : W1 ours with per-pass allocator counts and a kernel profile, then again with
#             expandable allocator segments
#   w1cfg   : W1 ours at max_num_seqs 512 with 8,192 and 16,384 tokens per step
#   w1ab    : W1 ours on this tree and on an older one in .cache/old/ (carried; made with
#             `git archive REV vlmserve | tar -x -C .cache/old`), then transformers alone
#   serveab : serveours on this tree, on the tree in .cache/old (as for w1ab), then this tree
#             again (RUNS as serveours, default inf@16,inf@64): results in $OUT/ours_{new,old,new2}
#   attention: attention kernels vs reference and the hardware
#   offload : image-embedding offload off/on and on/off
#   sweep   : decode tile of the Triton paged attention (BLOCK_N x warps x stages x splits)
#   serve   : `vlmserve serve` + `vlmserve bench serve` (TTFT/TPOT/ITL vs concurrency)
#   coldstart: the first 64 W1 requests of fresh processes (cold Triton cache, warm, no warm-up)
#   warmtests: the warm-up's GPU test and the attention / CUDA graph tests
#   vgraphs : vision-step CUDA graphs: host launch vs device time, then served with and
#             without them (serveours at 16/64/192, step traces)
#   servesbs: `vlmserve serve` vs vLLM's server (peers kit): concurrency 16/64/192, Poisson 8/16
#   multiturn: 64 conversations x 4 turns (2 images first), prefix caching: vlmserve serve,
#             then vLLM's server (peers kit); MT_SIDE=ours|vllm runs one of them
#   clientcheck: does `bench serve`'s client keep up? It and the openai SDK against a fake
#             server pacing tokens every 3 ms (benchmarks/client_fidelity.py; peers kit)
#   servebudget: serveours at step budgets 2048-16384 (BUDGETS=..., entries
#             TOKENS[:ENCODER_ROWS[:PREFILL_WHILE_DECODING]]), concurrency 16/64/192
#   w1prefix: W1 offline (512 requests) with prefix caching on, off, on
#   epdipc  : encoder and consumer processes on the GPU: memory over 1,000 requests (the leak
#             check), export + open + copy time per image; the negative control
#   sampler : one step's sampling at batch 192 (greedy, default, nucleus, top-k, seeded): host
#             and device ms, torch ops; this tree, then .cache/old (carried; the row-by-row
#             sampler: `git archive a62bc8b vlmserve | tar -x -C .cache/old`) if present
#   structured: structured outputs' cost offline (benchmarks/structured_time.py: the 2B's
#             requests plain, JSON schema, regex), served (serveours at 64, plain and JSON
#             mode: BENCH_EXTRA is the client's --extra-body), and their CPU tests on CUDA; xgrammar's
#             wheels carried in .cache/xgr (`pip download xgrammar apache-tvm-ffi --no-deps
#             -d .cache/xgr --python-version 3.12 --only-binary=:all: --platform
#             manylinux_2_28_x86_64`), pydantic from .whl (carried)
#   synctests: GPU tests of no device waits inside a launch and of the vision attention backends
#   vattn   : vision attention backends (torch, flash): host vs device time, serveours per
#             backend with the step trace
#   epdserve: encoder server + LLM server (--encoder-url) on the one GPU vs the LLM server
#             alone: bench serve at concurrency 16 and 64 (wheels from the peers kit, carried),
#             the LLM server's step trace per mode (trace_MODE.jsonl, summarized in .txt);
#             EPD_MODES="epd single epdmps": epdmps runs epd with both servers as clients of
#             one CUDA MPS daemon (kernels of the two processes run side by side instead of
#             time-slicing the GPU); skipped with a message where MPS cannot start;
#             EPD_LLM_SM_PCT=N: under MPS the LLM server's kernels use at most N% of the SMs;
#             EPD_ENCODER_ARGS: more options of the encoder server (--api-server-count 2);
#             EPD_LLM_ARGS: more options of the LLM server
#   fp8     : FP8 weights (quantization=fp8: the 2B's projections quantized to 128x128 blocks as
#             they load) against bfloat16: the FP8 kernel tests and CUDA parity, decode at
#             batch 1 / 64 / 256 with kernel profiles, W1 offline (w1ours' settings)
#   encfwd  : a MultimodalEncoder forward (benchmarks/encoder_forward.py): host launch, device
#             and export ms for 1 / 4 / 13 W1 images, alone and beside a busy Python thread
#   moe     : Qwen3-VL-MoE (qwen3-vl-30b-a3b-12l-random: 12 of Qwen3-VL-30B-A3B's 48 layers,
#             created on the GPU): the Triton experts against the reference, then W1 and
#             decode at batch 1 / 64 with a kernel profile (floor and FLOPs count the experts
#             a step's tokens are expected to pick, routing taken as uniform)
#   pack    : last: everything under $OUT (plots left out) as one $OUT/all.tgz (the device tool
#             brings back at most 8 files a call)
#   llavanext: W1 offline on llava-next-mistral-7b-random (created in /tmp/llnext), ours and
#             batch-1 decode; LN_SIDE=ours|vllm|both (vLLM from the peers kit, with
#             benchmarks/vllm_compat on its path; sbs.py's SBS_PROMPT=llava_next)
# Logs and JSON go to $OUT.
set -u
export VLMSERVE_CACHE=/tmp/vlmcache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "rc=$rc" >> "$OUT/$name.log"
  grep -v "it/s\]\|s/it\]" "$OUT/$name.log" | tail -n "${TAIL:-6}"
  return $rc
}
B="python -m vlmserve.benchmarks"
serve_variant() {  # serve_variant NAME [SERVER ARGS...]: serveours (RUNS, default 16/64/192)
  # with the step trace and these server arguments; results under $OUT/ours_NAME
  local name=$1; shift
  VLMSERVE_STEP_TRACE=$OUT/trace_$name.jsonl RUNS=${RUNS:-inf@16,inf@64,inf@192} \
    VLMSERVE_ARGS="--max-num-seqs 512 --max-num-batched-tokens 8192 --api-server-count 4 $*" \
    bash "$0" serveours
  mv "$OUT/ours" "$OUT/ours_$name"; mv "$OUT/serve_ours.log" "$OUT/serve_ours_$name.log"
  mv "$OUT/ours_server.log" "$OUT/ours_server_$name.log"
  python benchmarks/step_trace.py "$OUT/trace_$name.jsonl" > "$OUT/trace_$name.txt"
}
kit_deps() {  # the peers kit's wheels (.peer/p4) and those it lacks (aiohttp, pybase64:
  # benchmarks/kit_wheels.sh, carried as .cache/kitwheels, or copied to /tmp/kitwheels)
  # (or the server's wheels alone, benchmarks/server_wheels.sh's .whl, carried)
  local d; for d in .peer/p4 .whl; do
    [ -d /tmp/deps/zmq ] || [ ! -d $d ] || python3 -m pip install -q --no-index --no-deps \
      --target /tmp/deps $d/*.whl > "$OUT/pip.log" 2>&1
  done
  local w; for w in .cache/kitwheels /tmp/kitwheels; do
    [ -d /tmp/deps/aiohttp ] || [ ! -d $w ] || python3 -m pip install -q --no-index --no-deps \
      --target /tmp/deps $w/*.whl >> "$OUT/pip.log" 2>&1
  done
  [ -d /tmp/deps/aiohttp ] || echo "no aiohttp: run benchmarks/kit_wheels.sh, carry .cache/kitwheels"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for section in "${@:-checks}"; do
case "$section" in
checks)  # pyzmq from the peers kit (.peer/p4 carried, or /tmp/deps from an earlier call)
  kit_deps
  PYTHONPATH=$PWD:/tmp/deps step gpu_tests 300 python -m pytest -q -p no:cacheprovider \
    -o addopts="" tests/gpu -k "not triton_attention or (bf16 and bs16)"
  VLMSERVE_TEST_DEVICE=cuda PYTHONPATH=$PWD:/tmp/deps step cuda_parity 150 python -m pytest -q \
    -p no:cacheprovider -o addopts="" tests/engine/test_parity.py ;;
tpcuda)  # 2+ GPUs (nvidia-h200-x2): TP=2 on NCCL, each vision mode, offload held once per host
  step tp_cuda 400 python -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_tp_cuda.py ;;
quick)
  step gpu_quick 150 python -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/gpu/test_triton_ops.py tests/gpu/test_cuda_graphs.py tests/gpu/test_vision_triton.py \
    tests/models/test_processing.py ;;
speed)
  step speed_2b 280 $B.kernels --model qwen2-vl-2b-random --num-requests 512 \
    --decode-batches 1,64 --profile --out "$OUT/speed_2b.json" ;;
vision)
  step speed_2b_vtriton 200 $B.kernels --model qwen2-vl-2b-random --num-requests 256 \
    --decode-batches 1 --vision-attention-backend triton --profile \
    --out "$OUT/speed_2b_vtriton.json" ;;
final)
  step graphs 150 python -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/gpu/test_cuda_graphs.py
  step speed_2b_decode 60 $B.kernels --model qwen2-vl-2b-random --decode-batches 1,64 \
    --decode-only --out "$OUT/speed_2b_decode.json"
  step speed_7b 80 $B.kernels --model qwen2.5-vl-7b-random --decode-batches 1 \
    --decode-only --out "$OUT/speed_7b.json" ;;
decode)
  step speed_2b_decode 90 $B.kernels --model qwen2-vl-2b-random --decode-batches 1,64,256 \
    --decode-only --out "$OUT/speed_2b_decode.json"
  step speed_7b 80 $B.kernels --model qwen2.5-vl-7b-random --decode-batches 1 \
    --decode-only --out "$OUT/speed_7b.json" ;;
all)
  TAIL=3 bash "$0" quick speed decode
  TAIL=4 bash "$0" w1 ;;
speed7b)
  step speed_7b 200 $B.kernels --model qwen2.5-vl-7b-random --decode-batches 1 \
    --decode-only --profile --out "$OUT/speed_7b.json" ;;
w1)
  step w1 490 $B.throughput --model qwen2-vl-2b-random --num-requests 512 \
    --image-sizes 448,672,896 --prompt-len 50 --output-len 128 --backend both \
    --hf-batch-size 64 --max-num-seqs 512 --max-num-batched-tokens 16384 --repeats 3 \
    --out "$OUT/w1.json" ;;
fp8)
  step fp8_tests 300 python -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/gpu/test_triton_fp8.py tests/gpu/test_fp8_cuda.py
  for q in fp8 none; do
    step "speed_2b_$q" 200 $B.kernels --model qwen2-vl-2b-random --decode-batches 1,64,256 \
      --decode-only --profile --quantization $q --out "$OUT/speed_2b_$q.json"
  done
  for q in fp8 none; do
    step "w1_$q" 200 $B.throughput --model qwen2-vl-2b-random --num-requests 512 \
      --image-sizes 448,672,896 --prompt-len 50 --output-len 128 --backend vlmserve \
      --max-num-seqs 256 --max-num-batched-tokens 8192 --quantization $q \
      --out "$OUT/w1_$q.json"
  done ;;
w1ours)
  step w1_ours 200 $B.throughput --model qwen2-vl-2b-random --num-requests 512 \
    --image-sizes 448,672,896 --prompt-len 50 --output-len 128 --backend vlmserve \
    --max-num-seqs 256 --max-num-batched-tokens 8192 ${W1_EXTRA:-} --out "$OUT/w1_ours.json" ;;
w1ab)
  W1="--model qwen2-vl-2b-random --num-requests 512 --image-sizes 448,672,896 --prompt-len 50
      --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeats 3"
  step preprocess 60 python benchmarks/preprocess_time.py --out "$OUT/preprocess.json"
  step w1_new 170 $B.throughput $W1 --backend vlmserve --out "$OUT/w1_new.json"
  (cd .cache/old && step w1_old 170 python -m vlmserve.benchmarks.throughput $W1 \
    --backend vlmserve --out "$OUT/w1_old.json")
  step w1_hf 200 $B.throughput $W1 --backend hf --hf-batch-size 64 --out "$OUT/w1_hf.json" ;;
w1diag)  # where the first timed pass's time goes: kernels, allocator; expandable segments
  W1="--model qwen2-vl-2b-random --num-requests 512 --image-sizes 448,672,896 --prompt-len 50
      --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeats 3
      --backend vlmserve"
  step w1_diag 200 $B.throughput $W1 --device-profile --out "$OUT/w1_diag.json"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step w1_expandable 150 $B.throughput $W1 \
    --out "$OUT/w1_expandable.json" ;;
w1cfg)  # W1 ours with more requests running at once and larger steps (vLLM's H100 defaults)
  W1="--model qwen2-vl-2b-random --num-requests 512 --image-sizes 448,672,896 --prompt-len 50
      --output-len 128 --repeats 3 --backend vlmserve"
  for cfg in "512 8192" "512 16384"; do set -- $cfg
    step "w1_seqs$1_tokens$2" 130 $B.throughput $W1 --max-num-seqs $1 \
      --max-num-batched-tokens $2 --out "$OUT/w1_seqs$1_tokens$2.json"
  done ;;
attention)
  step attention 120 $B.attention_kernels --json "$OUT/attention.json" ;;
offload)
  for order in "" "--on-first"; do
    step "offload${order:+_on_first}" 280 $B.offload --model qwen2-vl-2b-random \
      --num-requests 64 --images-per-request 4 --image-size 1344 \
      --max-num-batched-tokens 2048 --output-len 64 --num-kv-blocks 40000 $order \
      --out "$OUT/offload${order:+_on_first}.json"
  done ;;
sweep)
  step sweep 200 python benchmarks/sweep_decode_attention.py --out "$OUT/sweep.jsonl" ;;
serve)  # needs the server's wheels in .whl/ (benchmarks/server_wheels.sh), carried
  python -m pip install -q --no-deps --no-index .whl/*.whl > "$OUT/pip.log" 2>&1
  python -m vlmserve serve qwen2-vl-2b-random --port 8011 > "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2> /dev/null && break; sleep 1; done
  step serve 240 $B.serve --base-url http://127.0.0.1:8011 --num-requests 256 \
    --request-rate 32 --concurrency 8,64,256 --out-dir "$OUT/serve"
  kill $server; wait $server ;;
coldstart)  # first W1 requests of fresh processes: run first on a fresh machine (empty
  # Triton cache); then the same once the cache is warm; then with the warm-up off, cold again
  # (a Triton cache of its own). sbs.py from the peers kit (.peer/p3, carried).
  S=${SBS:-/tmp/vparts/sbs.py}; W="max_num_seqs=512 max_num_batched_tokens=16384"
  BS1=0 step w1_64_cold 280 python3 "$S" vlmserve qwen2-vl-2b-random 64 $W
  grep -h "warm-up\|RESULT" "$OUT/w1_64_cold.log"
  BS1=0 step w1_64_warm 150 python3 "$S" vlmserve qwen2-vl-2b-random 64 $W
  TRITON_CACHE_DIR=/tmp/tc_nowarmup BS1=0 step w1_64_cold_nowarmup 150 python3 "$S" vlmserve \
    qwen2-vl-2b-random 64 $W kernel_warmup=False ;;
warmtests)  # the warm-up and the kernels it touches (attention launch rules moved)
  step warm_tests 300 python -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/gpu/test_warmup_gpu.py tests/gpu/test_triton_attention.py tests/gpu/test_cuda_graphs.py \
    -k "not triton_attention or (bf16 and bs16) or warmup" ;;
servesbs)  # vlmserve serve vs vLLM's server, one after the other (peers kit set up first)
  kit_deps
  VLMSERVE_ARGS=${VLMSERVE_ARGS:---max-num-seqs 512 --max-num-batched-tokens 8192} \
    bash /tmp/serve_sbs.sh /tmp/q2vl2b --num-requests 192 --output-len 128 --warmup-requests 16 \
    --runs "${RUNS:-inf@16,inf@64,inf@192,8@1000,16@1000}" ;;
sampler)
  step sampler_new 120 python3 benchmarks/sampler_time.py --device cuda
  [ ! -d .cache/old/vlmserve ] || PYTHONPATH=$PWD/.cache/old step sampler_old 300 \
    python3 benchmarks/sampler_time.py --device cuda ;;
structured)
  kit_deps
  python3 -m pip install -q --no-index --no-deps --target /tmp/xgr .cache/xgr/*.whl \
    >> "$OUT/pip.log" 2>&1
  [ -d /tmp/q2vl2b ] || python3 "${CKPTS:-.cache/checkpoints.py}" 2b /tmp/q2vl2b > /dev/null 2>&1
  PYTHONPATH=$PWD:/tmp/xgr:/tmp/deps step structured_tests 200 python3 -m pytest -x -q \
    -p no:cacheprovider -o addopts="" tests/engine/test_structured_outputs.py
  PYTHONPATH=$PWD:/tmp/xgr:/tmp/deps step structured_time 200 python3 \
    benchmarks/structured_time.py /tmp/q2vl2b
  # served: the same W1-shaped requests plain and in JSON mode (BENCH_EXTRA: the client's
  # --extra-body), concurrency 64
  for mode in plain json; do
    BENCH_EXTRA=$([ $mode = json ] && echo '{"response_format": {"type": "json_object"}}') \
      RUNS=${RUNS:-inf@64} bash "$0" serveours
    mv "$OUT/ours" "$OUT/ours_$mode"; mv "$OUT/serve_ours.log" "$OUT/serve_ours_$mode.log"
  done ;;
synctests)  # GPU tests: no device waits inside a step's launch; the vision attention backends
  TAIL=12 step sync_tests 400 python -m pytest -x -q -p no:cacheprovider -o addopts="" \
    tests/gpu/test_no_sync.py tests/gpu/test_vision_triton.py ;;
vattn)  # the vision attention backends: host launch vs device time on served mixes, then
  # serveours at 16/64/192 with the step trace per backend (VBACKENDS, default "torch
  # flash"); .whl and .cache carried
  kit_deps
  step vision_attn 120 python benchmarks/vision_attn.py --out "$OUT/vision_attn.json"
  for vb in ${VBACKENDS:-torch flash}; do
    serve_variant "$vb" --vision-attention-backend "$vb"
  done ;;
vgraphs)  # vision-step CUDA graphs: a step's host launch vs device time eager and replayed
  # (VG_BENCH=0 skips it), then serveours (RUNS, default 16/64/192) with the step trace: the
  # default (SDPA, eager) against graphs of up to VG_ROWS patch rows (default 8192: steps of
  # one or two W1 images; the graphs capture flash, the larger steps keep SDPA); VG_ARGS adds
  # server flags to the graphs run (e.g. "--vision-attention-backend flash"); .whl and
  # .cache carried
  kit_deps
  [ "${VG_BENCH:-1}" = 0 ] || step vision_graphs 120 python benchmarks/vision_graphs.py \
    --out "$OUT/vision_graphs.json"
  serve_variant eager
  serve_variant graphs --vision-cuda-graph-max-rows "${VG_ROWS:-8192}" ${VG_ARGS:-} ;;
serveours)  # vlmserve serve alone (its wheels from the peers kit's .peer/p4, carried), the
  # servesbs client and requests; VLMSERVE_ARGS for the server (e.g. --api-server-count 4);
  # SPY=SECONDS samples the server's processes with py-spy (benchmarks/spy_summary.py reads it;
  # SPY_FLAGS="--native" adds the C frames: a wait inside the CUDA driver shows there)
  kit_deps
  [ -d /tmp/q2vl2b ] || python3 "${CKPTS:-.cache/checkpoints.py}" 2b /tmp/q2vl2b > /dev/null 2>&1
  PYTHONPATH=$PWD:/tmp/deps:/tmp/xgr python3 -m vlmserve serve /tmp/q2vl2b --port 8001 \
    ${VLMSERVE_ARGS:---max-num-seqs 512 --max-num-batched-tokens 8192} > "$OUT/ours_server.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf localhost:8001/health > /dev/null && break; sleep 1; done
  if [ -n "${SPY:-}" ]; then  # SPY=SECONDS: py-spy (wheel in .cache/pyspy) samples every process
    python3 -m pip install -q --no-index --target /tmp/pyspy .cache/pyspy/*.whl > /dev/null 2>&1
    /tmp/pyspy/bin/py-spy record --pid $pid --subprocesses --nonblocking --rate 250 ${SPY_FLAGS:-} \
      --duration "$SPY" --format raw -o "$OUT/spy.txt" > "$OUT/spy.log" 2>&1 &
  fi
  PYTHONPATH=$PWD:/tmp/deps step serve_ours 400 python3 -m vlmserve.benchmarks.serve \
    --base-url http://127.0.0.1:8001 --num-requests 192 --output-len 128 --warmup-requests 16 \
    --runs "${RUNS:-inf@16,inf@64,inf@192,8@1000,16@1000}" --out-dir "$OUT/ours" \
    ${BENCH_EXTRA:+--extra-body "$BENCH_EXTRA"}
  kill $pid; wait $pid ;;
serveab)  # served A/B: this tree, the older tree in .cache/old, this tree again
  for side in new old new2; do
    if [ $side = old ]; then
      (cd .cache/old && CKPTS=../checkpoints.py RUNS=${RUNS:-inf@16,inf@64} bash ../../benchmarks/run_h200.sh serveours)
    else
      RUNS=${RUNS:-inf@16,inf@64} bash "$0" serveours
    fi
    mv "$OUT/ours" "$OUT/ours_$side"; mv "$OUT/serve_ours.log" "$OUT/serve_ours_$side.log"
    mv "$OUT/ours_server.log" "$OUT/ours_server_$side.log"
  done ;;
clientcheck)  # the benchmark client against a paced fake server, and the openai SDK's
  kit_deps
  TAIL=10 PYTHONPATH=$PWD:/tmp/deps step client_fidelity 240 python3 \
    benchmarks/client_fidelity.py --openai ;;
servebudget)  # serveours at several step budgets (issue 20: TPOT and p99 ITL vs TTFT);
  # BUDGETS: entries TOKENS[:ENCODER_ROWS[:PREFILL_WHILE_DECODING]] (empty fields: defaults),
  # e.g. "8192:2048" bounds the vision rows a step, "8192::2048" the prompt tokens of a step
  # with decodes ("2048 4096 8192 16384" by default); RUNS as serveours
  for b in ${BUDGETS:-2048 4096 8192 16384}; do
    IFS=: read -r tok enc cap <<< "$b"
    VLMSERVE_ARGS="--max-num-seqs 512 --max-num-batched-tokens $tok --api-server-count 4
      ${enc:+--max-num-encoder-tokens $enc} ${cap:+--max-num-prefill-tokens-while-decoding $cap}" \
      RUNS=${RUNS:-inf@16,inf@64,inf@192} bash "$0" serveours
    tag=$(echo "$b" | tr : _)
    mv "$OUT/ours" "$OUT/ours_budget$tag"; mv "$OUT/serve_ours.log" "$OUT/serve_ours_budget$tag.log"
  done ;;
w1ab512)  # W1 offline (sbs.py, 512 requests): this tree, the tree in .cache/old, this tree
  S=${SBS:-benchmarks/sbs.py}; W="max_num_seqs=512 max_num_batched_tokens=16384"
  BS1=0 step w1_512_new 150 python3 "$S" vlmserve qwen2-vl-2b-random 512 $W
  (cd .cache/old && PYTHONPATH=$PWD BS1=0 step w1_512_old 150 python3 "../../$S" vlmserve \
    qwen2-vl-2b-random 512 $W)
  BS1=0 step w1_512_new2 150 python3 "$S" vlmserve qwen2-vl-2b-random 512 $W ;;
multiturn)  # the multi-turn client against each server in turn (peers kit set up first)
  kit_deps
  mt() { PYTHONPATH=$PWD:/tmp/deps step "multiturn_$1" 300 python3 -m vlmserve.benchmarks.multiturn \
           --base-url "http://127.0.0.1:$2" --conversations 64 --turns 4 --images 2 \
           --output-len 64 --out "$OUT/multiturn_$1.json"; }
  up() { for _ in $(seq 300); do curl -sf "localhost:$1/health" > /dev/null && return 0; sleep 1; done; return 1; }
  if [ "${MT_SIDE:-ours}" != vllm ]; then
    PYTHONPATH=$PWD:/tmp/deps python3 -m vlmserve serve /tmp/q2vl2b --port 8001 \
      ${VLMSERVE_ARGS:-} > "$OUT/ours_server.log" 2>&1 &
    pid=$!; up 8001 && mt "ours${MT_TAG:-}" 8001; kill $pid; wait $pid
  fi
  if [ "${MT_SIDE:-vllm}" != ours ]; then
    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vsite:/tmp/deps python3 -m \
      vllm.entrypoints.openai.api_server --model /tmp/q2vl2b --port 8002 --max-model-len 4096 \
      --limit-mm-per-prompt '{"image":2}' > "$OUT/vllm_server.log" 2>&1 &
    pid=$!; up 8002 && mt vllm 8002; kill $pid; wait $pid
  fi ;;
w1prefix)  # W1 offline (sbs.py, 512 requests, no shared prefixes): prefix caching on, off, on
  S=${SBS:-benchmarks/sbs.py}; W="max_num_seqs=512 max_num_batched_tokens=16384"
  BS1=0 step w1_prefix_on 150 python3 "$S" vlmserve qwen2-vl-2b-random 512 $W
  BS1=0 step w1_prefix_off 150 python3 "$S" vlmserve qwen2-vl-2b-random 512 $W \
    enable_prefix_caching=False
  BS1=0 step w1_prefix_on2 150 python3 "$S" vlmserve qwen2-vl-2b-random 512 $W ;;
epdipc)  # pyzmq from the peers kit (.peer/p4, carried)
  kit_deps
  export PYTHONPATH=$PWD:/tmp/deps
  [ -d /tmp/q2vl2b ] || python3 "${CKPTS:-.cache/checkpoints.py}" 2b /tmp/q2vl2b > /dev/null 2>&1
  TAIL=12 step ipc 300 $B.encoder_ipc --model /tmp/q2vl2b --requests 1000 --out "$OUT/ipc.json"
  TAIL=12 step ipc_negative 200 $B.encoder_ipc --model /tmp/q2vl2b --requests 300 \
    --unopened-per-request 1 --out "$OUT/ipc_negative.json" ;;
epdserve)
  kit_deps
  [ -d /tmp/q2vl2b ] || python3 "${CKPTS:-.cache/checkpoints.py}" 2b /tmp/q2vl2b > /dev/null 2>&1
  up() { for _ in $(seq 300); do curl -sf "localhost:$1/health" > /dev/null && return 0
         kill -0 "$2" 2> /dev/null || return 1; sleep 1; done; return 1; }
  A="--max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.8 --api-server-count 4"
  bench() { PYTHONPATH=$PWD:/tmp/deps step "serve_$1" 300 python3 -m vlmserve.benchmarks.serve \
    --base-url http://127.0.0.1:8001 --num-requests 192 --output-len 128 --warmup-requests 16 \
    --runs "${RUNS:-inf@16,inf@64}" --out-dir "$OUT/$1"; }
  mps_start() {  # a CUDA MPS daemon of our own; 1 where a CUDA client cannot attach to it
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d \
      && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" && return 0
    echo "MPS unavailable"; cat /tmp/mps/log/control.log 2> /dev/null | tail -5; mps_stop; return 1
  }
  mps_stop() { echo quit | nvidia-cuda-mps-control 2> /dev/null; sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
  for mode in ${EPD_MODES:-epd single}; do
    extra=""
    if [ "$mode" = epdmps ]; then mps_start || continue; fi
    if [ "$mode" != single ]; then
      PYTHONPATH=$PWD:/tmp/deps python3 -m vlmserve serve /tmp/q2vl2b --role encoder --port 8003 \
        ${EPD_ENCODER_ARGS:-} > "$OUT/encoder_server_$mode.log" 2>&1 &
      enc=$!; up 8003 $enc || tail -5 "$OUT/encoder_server_$mode.log"
      extra="--encoder-url http://127.0.0.1:8003"
    fi
    sm=""  # under MPS, EPD_LLM_SM_PCT caps the SMs the LLM server's kernels may use
    [ "$mode" != epdmps ] || [ -z "${EPD_LLM_SM_PCT:-}" ] \
      || sm="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$EPD_LLM_SM_PCT"
    env $sm VLMSERVE_STEP_TRACE=$OUT/trace_$mode.jsonl PYTHONPATH=$PWD:/tmp/deps python3 -m vlmserve \
      serve /tmp/q2vl2b --port 8001 $A $extra ${EPD_LLM_ARGS:-} > "$OUT/llm_$mode.log" 2>&1 &
    pid=$!; up 8001 $pid && bench "$mode" || tail -5 "$OUT/llm_$mode.log"
    curl -s localhost:8001/stats > "$OUT/llm_${mode}_stats.json"
    python3 benchmarks/step_trace.py "$OUT/trace_$mode.jsonl" > "$OUT/trace_$mode.txt"
    if [ "$mode" != single ]; then
      curl -s localhost:8003/stats > "$OUT/encoder_stats_$mode.json"
      cat "$OUT/encoder_stats_$mode.json"; echo; kill $enc; wait $enc
    fi
    [ "$mode" != epdmps ] || echo get_server_list | nvidia-cuda-mps-control  # attached?
    kill $pid; wait $pid
    [ "$mode" != epdmps ] || mps_stop
  done ;;
llavanext)
  if [ ! -d /tmp/llnext ]; then  # the hub's names, which vLLM reads (vlmserve reads both)
    step llnext_create 300 python3 -c "from vlmserve.models.builtin import create_checkpoint \
as c; import torch; c('llava-next-mistral-7b-random', '/tmp/llnext', dtype=torch.bfloat16, \
device='cuda')"
    python3 benchmarks/hub_names.py /tmp/llnext
  fi
  S=${SBS:-benchmarks/sbs.py}
  if [ "${LN_SIDE:-both}" != vllm ]; then
    SBS_PROMPT=llava_next PYTHONPATH=$PWD:/tmp/deps step llnext_ours 280 python3 "$S" vlmserve /tmp/llnext 512 \
      max_num_seqs=512 max_num_batched_tokens=16384
  fi
  if [ "${LN_SIDE:-both}" != ours ]; then
    SBS_PROMPT=llava_next VLLM_USE_FLASHINFER_SAMPLER=0 \
      PYTHONPATH=$PWD/benchmarks/vllm_compat:/tmp/vsite:/tmp/deps \
      step llnext_vllm 400 python3 "$S" vllm /tmp/llnext 512
  fi ;;
moe)
  step moe_tests 120 python -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/gpu/test_triton_moe.py
  step speed_moe 400 $B.kernels --model qwen3-vl-30b-a3b-12l-random --num-requests 256 \
    --decode-batches 1,64 --profile --out "$OUT/speed_moe.json" ;;
encfwd)
  TAIL=8 step encoder_forward 200 python benchmarks/encoder_forward.py --model qwen2-vl-2b-random \
    --batches 1,4,13 --out "$OUT/encoder_forward.json" ;;
pack)
  (cd "$OUT" && find . -name "*.png" -delete && tar czf /tmp/all.tgz . \
    && find . -mindepth 1 -delete && mv /tmp/all.tgz . && ls -l all.tgz) ;;
*) echo "unknown section $section" ;;
esac
done
