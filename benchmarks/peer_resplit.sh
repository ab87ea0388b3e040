#!/usr/bin/env bash
# Re-splits the peers kit's vLLM parts (.peer/p1..p3, made by ../shared/peers/bundle.sh) into
# three parts of at most 40 MB, so that each fits a device call beside the tracked files
# (a call carries at most 64 MiB in all; the tracked tree is about 16 MiB). Run after
# bundle.sh; device_setup.sh joins the parts by name (vpart.*) as before.
set -eu
cd "$(dirname "$0")/../.peer"
tmp=$(mktemp -d)
cat p1/vpart.* p2/vpart.* p3/vpart.* > "$tmp/v.tar.zst"
rm p1/vpart.* p2/vpart.* p3/vpart.*
split -b 40000000 "$tmp/v.tar.zst" "$tmp/vpart."
mv "$tmp/vpart.aa" p1/ && mv "$tmp/vpart.ab" p2/ && mv "$tmp/vpart.ac" p3/
rm -r "$tmp"
du -sh p1 p2 p3 p4
