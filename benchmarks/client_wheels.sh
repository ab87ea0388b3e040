#!/usr/bin/env bash
# Wheels of the benchmark client (aiohttp and what it needs) for the GPU machine (Python 3.12,
# x86_64), which the peers kit lacks: into .cache/clientwheels (3 MB). Carry it with the first
# device call of the peers kit and copy it to /tmp/clientwheels there; run_h200.sh installs it.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .cache/clientwheels
python3 -m pip download -q -d .cache/clientwheels --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 aiohttp
du -sh .cache/clientwheels
