#!/usr/bin/env bash
# Wheels the peers kit lacks, for the GPU machine (Python 3.12, x86_64): the benchmark client's
# (aiohttp and what it needs), the server's pybase64 (data-URL images) and loguru (vLLM's
# Qwen3.5 imports it through compressed-tensors), into .cache/kitwheels (3.5 MB). Carry it with the first device call of the peers kit and copy it to /tmp/kitwheels
# there; run_h200.sh installs it.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .cache/kitwheels
python3 -m pip download -q -d .cache/kitwheels --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 aiohttp pybase64 loguru
du -sh .cache/kitwheels
