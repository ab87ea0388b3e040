#!/usr/bin/env bash
# Wheels of the server and `bench serve` for the GPU machine (Python 3.12, x86_64), which
# has torch, numpy and pillow but no fastapi, uvicorn or aiohttp. Run here, then pass
# carry: [".whl"] to the device call that runs `bash benchmarks/run_h200.sh serve`.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q -d .whl --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  fastapi uvicorn pydantic prometheus-client aiohttp matplotlib
rm -f .whl/numpy-* .whl/pillow-*  # the machine's own stay (torch is built against them)
du -sh .whl
