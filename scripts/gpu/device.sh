#!/usr/bin/env bash
# The GPU machine's side of the GPU bundle (scripts/gpu/prepare.sh builds it; docs/gpu.md has the
# call sequence). Run from the repo root there, one subcommand per step:
#   bash scripts/gpu/device.sh receive N   copy part N from the carried .gpuN into $VIME_GPU_PARTS
#   bash scripts/gpu/device.sh install     check the sha256, unpack into $VIME_GPU_SITE, make the
#                                          console scripts, print versions, check imports + redis
#   bash scripts/gpu/device.sh env         print the export lines later commands need
#   bash scripts/gpu/device.sh run CMD...  run CMD with that environment, output teed to $OUT
# The vime distributions are not installed: the repo's own folders go on PYTHONPATH, so every
# call runs the working tree it carried (no build, no network, no setuptools download).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PARTS=${VIME_GPU_PARTS:-/tmp/vime-parts}
SITE=${VIME_GPU_SITE:-/tmp/vime-site}
PY=${PYTHON:-python3}
die() {
  echo "device.sh: $*" >&2
  exit 1
}

receive() {
  local n=${1:?usage: device.sh receive N} src="$ROOT/.gpu$1"
  [ -d "$src" ] || die "$src is missing: name .gpu$n in the call's carry"
  mkdir -p "$PARTS"
  cp "$src"/part_* "$src/SHA256SUMS" "$PARTS/"
  (cd "$PARTS" && grep ' part_' SHA256SUMS | sha256sum -c --ignore-missing --quiet) \
    || die "a part in $PARTS is damaged"
  echo "received .gpu$n; parts here: $(cd "$PARTS" && ls part_* | wc -l) of $(grep -c ' part_' "$PARTS/SHA256SUMS")"
}

install_bundle() {
  cd "$PARTS" 2> /dev/null || die "no parts in $PARTS: run 'receive N' first"
  mapfile -t parts < <(grep ' part_' SHA256SUMS | awk '{print $2}')
  for p in "${parts[@]}"; do [ -f "$p" ] || die "$p is missing: receive every part on this machine first"; done
  local want got t0=$SECONDS
  want=$(awk '$2 == "bundle.tar.xz" {print $1}' SHA256SUMS)
  got=$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)
  [ "$want" = "$got" ] || die "bundle sha256 $got != $want"
  rm -rf "$SITE"
  mkdir -p "$SITE"
  cat "${parts[@]}" | xz -dc -T0 | tar -x -C "$SITE"
  "$PY" "$ROOT/scripts/gpu/console_scripts.py" "$SITE/lib" "$SITE/bin"
  echo "unpacked into $SITE in $((SECONDS - t0)) s ($(du -sh "$SITE" | cut -f1)); sha256 $got"
  eval "$(print_env)"
  "$PY" "$ROOT/scripts/gpu/verify.py"
}

print_env() {
  local path="$ROOT" d
  for d in "$ROOT"/services/*/; do
    compgen -G "$d/vime_*/__init__.py" > /dev/null && path="$path:${d%/}"
  done
  cat << EOF
export VIME_GPU_SITE=$SITE
export PYTHONPATH=$path:$SITE/lib\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:$SITE/redis/bin:\$PATH
export VIME_REDIS_SERVER=$SITE/redis/bin/redis-server
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1
export VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
EOF
}

run() {
  [ $# -gt 0 ] || die "usage: device.sh run CMD..."
  [ -d "$SITE/lib" ] || die "$SITE is not installed: run 'install' first (same warm machine)"
  eval "$(print_env)"
  cd "$ROOT"
  [ -n "${OUT:-}" ] || exec "$@"
  local log="$OUT/${RUN_LOG:-run}.log" rc=0
  mkdir -p "$OUT"
  "$@" 2>&1 | tee "$log" || rc=$?
  # Files over 16 MiB do not come back from $OUT: keep the end of a long log.
  if [ "$(stat -c %s "$log")" -gt 15728640 ]; then
    tail -c 15728640 "$log" > "$log.tail" && mv "$log.tail" "$log"
  fi
  return "$rc"
}

case "${1:-}" in
  receive) receive "${2:-}" ;;
  install) install_bundle ;;
  env) print_env ;;
  run)
    shift
    run "$@"
    ;;
  *) die "usage: device.sh receive N | install | env | run CMD..." ;;
esac
