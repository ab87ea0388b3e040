#!/usr/bin/env bash
# Several engines sharing one GPU against one engine using all of it (docs/ray.md): the
# built-in qwen2-vl-2b-random (Qwen2-VL-2B's shapes) served by
#   single : one `vlmserve serve` (its default memory share)
#   dp2    : `vlmserve serve -dp 2 --gpu-memory-utilization 0.42` (two engine cores)
#   ray2   : the Ray Serve application, two LLM replicas of half a GPU each (the same memory
#            share), behind the cache-affine ingress (`routing: affinity`)
#   ray2random : the same, routed at random (the affinity's baseline)
# each measured with `vlmserve bench serve` (192 W1-shaped streamed chats at concurrency 64:
# RUNS) and a multi-turn chat (16 conversations of 4 turns, 2 images in the first: MT_ARGS),
# with the prefix cache's hits over that chat's prompt tokens (the server's /stats before and
# after). Results under $OUT/replicas.
#
# Wheels: on your machine `bash ../shared/peers/bundle.sh` (its .peer/p4: the server's
# wheels), `bash benchmarks/kit_wheels.sh` (.cache/kitwheels) and `bash
# benchmarks/ray_wheels.sh` (.cache/ray/a, .cache/ray/b). On the GPU machine, project root,
# three calls back to back (the machine is given back after 30 s idle):
#   1 carry .cache/ray/a                    : mkdir -p /tmp/rayparts && cp .cache/ray/a/* /tmp/rayparts/
#   2 carry .cache/ray/b .cache/kitwheels   : cp -r .cache/ray/b/* .cache/kitwheels /tmp/rayparts/
#   3 carry .peer/p4                        : bash benchmarks/replicas_gpu.sh single dp2 ray2 ray2random
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_DISABLE_IMPORT_WARNING=1
dir=$OUT/replicas; mkdir -p "$dir"
export PYTHONPATH=$PWD:/tmp/raydeps:/tmp/deps${PYTHONPATH:+:$PYTHONPATH}
# CKPT, SERVER_ARGS (e.g. --device cpu --dtype float32) and BENCH_ARGS (e.g. --num-requests 8
# --image-sizes 56): a dry run elsewhere
ck=${CKPT:-/tmp/q2vl2b}
up() {  # up PORT PID: until /health answers, while PID lives
  for _ in $(seq 1 600); do
    curl -sf "localhost:$1/health" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || return 1; sleep 1
  done; return 1
}
measure() {  # measure PORT TAG
  python3 -m vlmserve.benchmarks.serve --base-url "http://127.0.0.1:$1" --num-requests 192 \
    --output-len 128 --warmup-requests 16 --runs "${RUNS:-inf@64}" --out-dir "$dir/serve_$2" \
    ${BENCH_ARGS:-} \
    > "$dir/serve_$2.log" 2>&1
  python3 - "$dir/serve_$2/serve.json" "$2" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"{sys.argv[2]:>11} c{r['concurrency']}: {r['requests_per_s']:.2f} req/s, failed "
          f"{r['failed']}, p99 TTFT {r['p99_ttft_ms']:.0f} ms, mean TPOT {r['mean_tpot_ms']:.2f} ms")
PY
  curl -s "localhost:$1/stats" > "$dir/stats_$2_before.json"
  python3 -m vlmserve.benchmarks.multiturn --base-url "http://127.0.0.1:$1" \
    ${MT_ARGS:---conversations 16 --turns 4 --images 2 --output-len 64} \
    --out "$dir/multiturn_$2.json" > "$dir/multiturn_$2.log" 2>&1
  curl -s "localhost:$1/stats" > "$dir/stats_$2.json"
  python3 - "$dir/stats_$2_before.json" "$dir/stats_$2.json" "$2" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
hit, asked = (b[k] - a[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens"))
print(f"{sys.argv[3]:>11} multi-turn prefix-cache hits {100 * hit / max(asked, 1):.1f}% of "
      f"{asked} prompt tokens")
PY
}
serve_local() {  # serve_local TAG [FLAGS...]
  local tag=$1; shift
  python3 -m vlmserve serve "$ck" --port 8001 --max-model-len 4096 ${SERVER_ARGS:-} "$@" \
    > "$dir/server_$tag.log" 2>&1 &
  local pid=$!
  if up 8001 $pid; then measure 8001 "$tag"; else echo "$tag did not come up"; tail -5 "$dir/server_$tag.log"; fi
  kill -TERM $pid; wait $pid 2> /dev/null
}
serve_ray() {  # serve_ray TAG ROUTING
  python3 -c "import ray.scripts.scripts as s; s.main()" start --head --num-gpus 1 \
    --disable-usage-stats --include-dashboard false > "$dir/ray_start.log" 2>&1
  python3 - "$ck" "$2" > "$dir/server_$1.log" 2>&1 <<'PY' &
import sys, threading
import ray
from ray import serve
from vlmserve.entrypoints.ray.app import build_app
ray.init(address="auto", logging_level="ERROR")
serve.start(http_options={"host": "127.0.0.1", "port": 8000})
engine = {"max_model_len": 4096, "gpu_memory_utilization": 0.42}
serve.run(build_app({
    "model": sys.argv[1], "engine": engine, "routing": sys.argv[2],
    "server": {"preprocess_workers": 2, "log_level": "warning"},
    "llm": {"num_replicas": 2, "max_ongoing_requests": 256,
            "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.5}},
    "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}), name="vlmserve", route_prefix="/")
print("deployed", flush=True)
threading.Event().wait()
PY
  local pid=$!
  if up 8000 $pid; then measure 8000 "$1"; else echo "$1 did not come up"; tail -20 "$dir/server_$1.log"; fi
  kill -TERM $pid; wait $pid 2> /dev/null
  python3 -c "import ray.scripts.scripts as s; s.main()" stop --force > /dev/null 2>&1
}
if [ ! -d /tmp/raydeps/ray ] && [ -d /tmp/rayparts ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps .peer/p4/*.whl \
    /tmp/rayparts/kitwheels/*.whl 2>&1 | grep -v WARNING
  cat /tmp/rayparts/ray.part.* > "/tmp/rayparts/$(cat /tmp/rayparts/ray_wheel_name)"
  rm /tmp/rayparts/ray.part.*
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/raydeps \
    /tmp/rayparts/*.whl 2>&1 | grep -v WARNING
fi
[ -e "$ck" ] || [ "$ck" != /tmp/q2vl2b ] || python3 -c "
import torch; from vlmserve.models.builtin import create_checkpoint
create_checkpoint('qwen2-vl-2b-random', '$ck', dtype=torch.bfloat16, device='cuda')" > /dev/null 2>&1
for section in "$@"; do
  case $section in
    single) serve_local single ;;
    dp2) serve_local dp2 --data-parallel-size 2 --gpu-memory-utilization 0.42 ;;
    ray2) serve_ray ray2 affinity ;;
    ray2random) serve_ray ray2random random ;;
    *) echo "unknown section $section" ;;
  esac
done
