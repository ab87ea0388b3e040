#!/usr/bin/env bash
# CPU time a streamed token costs the front end, per thread (CPU, tiny model):
#   bash benchmarks/frontend_cpu.sh [OUTPUT_LEN [REQUESTS [server args...]]]
# Serves tiny-qwen2-vl on 127.0.0.1:8123, warms it with 64 short requests, then streams
# REQUESTS text-only chats of OUTPUT_LEN tokens (default 128 and 384) at concurrency 64
# with `vlmserve bench serve`, and prints the front-end process's threads' CPU time (from
# /proc) per streamed token: the main thread (HTTP, SSE) and the I/O thread (the core's
# socket, detokenization). With PYTHONPATH=benchmarks/gc_probe every process also writes
# its full garbage-collector passes (duration @ seconds since start) to /tmp/gc_probe/.
set -u
L=${1:-128}; N=${2:-384}; shift $(( $# < 2 ? $# : 2 ))
vlmserve serve tiny-qwen2-vl --device cpu --dtype float32 --max-num-seqs 256 --port 8123 \
  "$@" > /tmp/frontend_cpu_server.log 2>&1 &
srv=$!
for _ in $(seq 120); do curl -sf localhost:8123/health > /dev/null && break; sleep 1; done
bench() { vlmserve bench serve --base-url http://127.0.0.1:8123 --runs inf@64 \
  --images-per-request 0 --warmup-requests 0 "$@"; }
bench --num-requests 64 --output-len 32 > /dev/null 2>&1
threads() { for t in /proc/$srv/task/*; do
  echo "$(basename "$t") $(cut -d' ' -f14,15 "$t/stat" | tr ' ' +)"; done | sort; }
threads > /tmp/frontend_cpu_t0
bench --num-requests "$N" --output-len "$L" 2>&1 | grep -E "^ *run|inf/s"
threads > /tmp/frontend_cpu_t1
join /tmp/frontend_cpu_t0 /tmp/frontend_cpu_t1 | while read -r tid a b; do
  ticks=$(( ($b) - ($a) ))
  [ $ticks -gt 5 ] && python3 -c "print(f'thread $tid ($(cat /proc/$srv/task/$tid/comm 2>/dev/null)): {$ticks * 1e4 / ($N * $L):.1f} us per token')"
done
kill $srv; wait $srv
