#!/usr/bin/env bash
# vime's images built and its system run under `docker compose`, on a machine without a container
# registry (only Debian's mirror and PyPI reachable), as CI does it:
#
#   scripts/containers.sh          # CI: a private Docker engine, the images, `--profile cpu up`,
#                                  # tests/containers, `down -v`; the engine and its data are
#                                  # removed at the end, also on failure
#   scripts/containers.sh images   # only the images, into the engine DOCKER_HOST names (a laptop
#                                  # without registry access; deploy/README.md)
#
# Images (tags as deploy/compose.yaml names them, VIME_IMAGE_PREFIX / VIME_TAG):
#   vime-python:3.11-bookworm  Debian bookworm minbase + Python 3.11 (debootstrap, docker import),
#                              the host's extra CA certificates, pip on the system CA bundle
#   vime-redis, vime-cpu-all, vime-cpu   docker/cpu.Dockerfile targets redis, all, service (BuildKit),
#                              torch from the CPU wheel this host's pip finds (its find-links),
#                              served to the build on loopback
# Needs root (apt, debootstrap, dockerd). Settings: VIME_DEBIAN_MIRROR, VIME_VENV, VIME_KEEP_WORK=1
# (keep the work directory: logs, rootfs), extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=ci
if [ "${1:-}" = images ] || [ "${1:-}" = ci ]; then MODE=$1; shift; fi
VENV="${VIME_VENV:-.venv}"
PREFIX="${VIME_IMAGE_PREFIX:-vime}"
TAG="${VIME_TAG:-0.1.0}"
BASE_IMAGE="$PREFIX-python:3.11-bookworm"
MIRROR="${VIME_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_VERSION="$(sed -n 's/^torch==//p' docker/cpu-constraints.txt)"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/vime-containers.XXXXXX")"
LOGS="$WORK/logs"; mkdir -p "$LOGS"
PHASES=()
DOCKER="" DOCKERD_PID="" WHEEL_PID="" STACK_UP="" PHASE=""

log() { echo "[containers] $*" >&2; }

# Run a phase, timed; its output goes to a log whose end `finish` prints when it fails. (Not
# under `if`: bash would switch errexit off inside the phase's functions.)
phase() {
  local name=$1 t0=$SECONDS; shift
  log "$name"
  PHASE=$name
  "$@" >"$LOGS/$name.log" 2>&1
  PHASE=""
  PHASES+=("$(printf '%-14s %4d s' "$name" $((SECONDS - t0)))")
}

summary() {
  [ "${#PHASES[@]}" -gt 0 ] || return 0
  echo "== containers: timings"
  printf '  %s\n' "${PHASES[@]}"
  printf '  %-14s %4d s\n' total "$SECONDS"
  if [ -n "$DOCKER" ] && "$DOCKER" version >/dev/null 2>&1; then
    echo "== containers: image sizes"
    "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep "^$PREFIX-" | sed 's/^/  /'
  fi
}

# --- tools ---------------------------------------------------------------------------------------
install_tools() {
  local need=()
  command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  command -v iptables >/dev/null 2>&1 || need+=(iptables)
  [ "${#need[@]}" -eq 0 ] && return 0
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; }
}

# A docker CLI that builds with BuildKit: one with the buildx plugin, or one older than 23 (BuildKit
# built in, as Debian's docker.io). A newer CLI without buildx falls back to the legacy builder,
# which cannot `COPY --chmod` and builds every stage.
pick_docker() {
  local c major
  for c in docker /usr/bin/docker; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" buildx version >/dev/null 2>&1; then echo "$c"; return; fi
    major="$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)"
    if [ -n "$major" ] && [ "$major" -lt 23 ]; then echo "$c"; return; fi
  done
  log "no docker CLI that builds with BuildKit (install docker.io, or the buildx plugin)"
  return 1
}

# --- a private engine -----------------------------------------------------------------------------
start_engine() {
  local sock="$WORK/docker.sock"
  # No default bridge (compose makes its own network; builds use the host's): nothing to clash
  # with another engine on this machine.
  $SUDO dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    -H "unix://$sock" --bridge none >"$LOGS/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  export DOCKER_HOST="unix://$sock"
  for _ in $(seq 60); do
    "$DOCKER" version >/dev/null 2>&1 && return 0
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
  done
  tail -n 30 "$LOGS/dockerd.log" >&2
  return 1
}

stop_engine() {
  [ -n "$DOCKERD_PID" ] || return 0
  $SUDO kill "$DOCKERD_PID" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  $SUDO kill -9 "$DOCKERD_PID" 2>/dev/null || true
  # Mounts the engine left behind (a killed engine does not unmount its layers).
  awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r $SUDO umount -l
  DOCKERD_PID=""
}

# --- images --------------------------------------------------------------------------------------
base_image() {
  local rootfs="$WORK/rootfs"
  $SUDO debootstrap --variant=minbase \
    --include=python3.11,python3-venv,python-is-python3,ca-certificates,passwd \
    bookworm "$rootfs" "$MIRROR"
  # TLS to PyPI may be re-signed by a local CA on this kind of machine: the image trusts what
  # the host trusts, and pip uses the system bundle (not its own certifi copy).
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    $SUDO cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    $SUDO chroot "$rootfs" update-ca-certificates
  fi
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' | $SUDO tee "$rootfs/etc/pip.conf" >/dev/null
  # Slim like Debian's own images: later installs bring no docs, man pages or translations, and
  # apt keeps no package caches in a layer (~80 MB after an `apt-get update`).
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
    | $SUDO tee "$rootfs/etc/dpkg/dpkg.cfg.d/docker" >/dev/null
  local clean='"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"'
  printf '%s\n' "DPkg::Post-Invoke { $clean; };" "APT::Update::Post-Invoke { $clean; };" \
    'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' \
    | $SUDO tee "$rootfs/etc/apt/apt.conf.d/docker-clean" >/dev/null
  $SUDO find "$rootfs/usr/share/doc" -mindepth 1 -type f -not -name copyright -delete
  $SUDO rm -rf "$rootfs"/usr/share/{man,info,locale}/* "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*
  $SUDO tar --numeric-owner -C "$rootfs" -c . | "$DOCKER" import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$BASE_IMAGE"
  $SUDO rm -rf "$rootfs"
}

# The CPU torch wheel this host's pip installs (scripts/setup.sh: its configured find-links), on a
# loopback server for the build; TORCH_ARGS stay empty (the Dockerfile's PyTorch CPU index) when
# this host has no such wheel.
TORCH_ARGS=()
torch_wheel() {
  local wheels="$WORK/wheels" port
  if ! "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" \
      "torch==$TORCH_VERSION+cpu"; then
    echo "no local torch $TORCH_VERSION+cpu wheel: the build uses the PyTorch CPU index"
    return 0
  fi
  port="$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  "$VENV/bin/python" -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >"$LOGS/wheels.log" 2>&1 &
  WHEEL_PID=$!
  TORCH_ARGS=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$port/" --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
  ls -l "$wheels"
}

build() {
  local target=$1 image=$2
  DOCKER_BUILDKIT=1 "$DOCKER" build --progress plain --network host -f docker/cpu.Dockerfile \
    --target "$target" --build-arg "PYTHON_IMAGE=$BASE_IMAGE" ${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"} \
    -t "$image" .
}

# `all` first: it contains `redis` and shares every layer of `service` but the last.
images() {
  phase base-image base_image
  phase torch-wheel torch_wheel
  phase build-all build all "$PREFIX-cpu-all:$TAG"
  phase build-redis build redis "$PREFIX-redis:$TAG"
  phase build-service build service "$PREFIX-cpu:$TAG"
}

# --- the system ----------------------------------------------------------------------------------
# A loopback address where the two published ports are free (another stack may hold 127.0.0.1's).
free_bind() {
  "$VENV/bin/python" - <<'EOF'
import random, socket
for last in random.sample(range(2, 255), 253):
    addr = f"127.0.{random.randrange(256)}.{last}"
    try:
        for port in (18080, 18084):
            with socket.socket() as s:
                s.bind((addr, port))
    except OSError:
        continue
    print(addr)
    break
EOF
}

compose() { "$VENV/bin/docker-compose" -f deploy/compose.yaml "$@"; }

stack_env() {
  export COMPOSE_PROJECT_NAME=vime-ci COMPOSE_PROFILES=cpu
  export VIME_REDIS_IMAGE="$PREFIX-redis:$TAG"
  # The router asks for 65536 open files; the container cannot go above this host's hard limit.
  local hard; hard="$(ulimit -Hn)"
  [ "$hard" = unlimited ] || [ "$hard" -ge 65536 ] || export VIME_ROUTER_NOFILE="$hard"
  VIME_BIND="$(free_bind)"; export VIME_BIND
  export VIME_TOKEN_FILE="$WORK/api_token"
  "$VENV/bin/python" -c 'import secrets; print(secrets.token_hex(32))' >"$VIME_TOKEN_FILE"
  chmod 0644 "$VIME_TOKEN_FILE"  # read by uid 10001 in the containers (a compose file secret)
  log "published on $VIME_BIND (18080 router, 18084 trainer)"
}

up() {
  STACK_UP=1
  compose up -d --no-build --pull never --wait --wait-timeout 600
  compose ps
}

container_tests() {
  local t0=$SECONDS
  log "tests"
  VIME_CONTAINERS=1 "$VENV/bin/python" -m pytest -q -raP -p no:cacheprovider tests/containers "$@"
  PHASES+=("$(printf '%-14s %4d s' tests $((SECONDS - t0)))")
}

down() {
  STACK_UP=""
  compose down -v --timeout 30
}

# --- clean-up, always --------------------------------------------------------------------------
finish() {
  local rc=$?
  set +e
  if [ -n "$PHASE" ]; then
    tail -n 60 "$LOGS/$PHASE.log" >&2
    log "$PHASE failed"
  fi
  if [ -n "$STACK_UP" ]; then
    [ "$rc" -ne 0 ] && compose logs --no-color --tail 40 >&2
    down >"$LOGS/down.log" 2>&1
  fi
  [ -n "$WHEEL_PID" ] && kill "$WHEEL_PID" 2>/dev/null
  summary
  stop_engine
  if [ "${VIME_KEEP_WORK:-}" = 1 ]; then log "kept $WORK"; else $SUDO rm -rf "$WORK"; fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM

phase tools install_tools
bash scripts/setup.sh
DOCKER="$(pick_docker)"
if [ "$MODE" = images ]; then
  "$DOCKER" version >/dev/null || { log "no Docker engine at ${DOCKER_HOST:-the default socket}"; exit 1; }
  images
  exit 0
fi
phase engine start_engine
images
stack_env
phase up up
container_tests "$@"
phase down down
