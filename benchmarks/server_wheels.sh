#!/usr/bin/env bash
# Wheels of the server and `bench serve` for the GPU machine (Python 3.12, x86_64), which
# has torch, numpy, pillow and uvloop but no fastapi, uvicorn, pyzmq or aiohttp: the `serve`
# and `bench` extras and the messaging dependencies. Run here, then pass carry: [".whl"] to
# the device call that runs `bash benchmarks/run_h200.sh serve`. (The peers kit's .peer/p4
# plus benchmarks/kit_wheels.sh cover the same for the sections that use the kit.)
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q -d .whl --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  fastapi uvicorn httptools pydantic prometheus-client httpx pybase64 pyzmq msgspec aiohttp \
  matplotlib
rm -f .whl/numpy-* .whl/pillow-*  # the machine's own stay (torch is built against them)
du -sh .whl
