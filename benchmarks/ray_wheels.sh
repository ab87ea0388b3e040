#!/usr/bin/env bash
# Ray Serve's wheels for the GPU machine (Python 3.12, no package index there), in two parts
# that each fit a device call's 64 MiB: .cache/ray/a and .cache/ray/b (git-ignored). The
# wheels the GPU image or the peers kit (.peer/p4, .cache/kitwheels) already hold stay out.
# Ray's own wheel (about 80 MB) is split; benchmarks/replicas_gpu.sh joins it again.
#   bash benchmarks/ray_wheels.sh        (project root; the Ray version of the local install)
set -euo pipefail
version=$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)
dl=.cache/ray/dl
rm -rf .cache/ray && mkdir -p "$dl" .cache/ray/a .cache/ray/b
python3 -m pip download -q -d "$dl" --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 "ray[serve]==$version" 2>&1 | grep -v "^WARNING" || true
have=$(ls .peer/p4 .cache/kitwheels 2>/dev/null | sed 's/-[0-9].*//' | sort -u)
for whl in "$dl"/*.whl; do
  name=$(basename "$whl" | sed 's/-[0-9].*//')
  case $name in
    ray) ;;
    numpy|py_spy) rm "$whl" ;;  # the GPU image has numpy; py-spy is optional
    *) if grep -qx "$name" <<< "$have"; then rm "$whl"; else mv "$whl" .cache/ray/b/; fi ;;
  esac
done
ray=$(ls "$dl"/ray-*.whl)
basename "$ray" > .cache/ray/b/ray_wheel_name
split -b 52M "$ray" .cache/ray/a/ray.part.
mv .cache/ray/a/ray.part.ab .cache/ray/b/
[ ! -e .cache/ray/a/ray.part.ac ] || { echo "ray's wheel needs a third part" >&2; exit 1; }
rm -rf "$dl"
du -sh .cache/ray/a .cache/ray/b
