#!/usr/bin/env bash
# Prepare a fresh machine for vime: redis-server, a virtual environment in .venv with the CPU
# build of torch and every vime distribution installed editable. Idempotent: a second run only
# checks. Used by scripts/train.sh, scripts/test.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VIME_VENV:-.venv}"
PY="${PYTHON:-python3}"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[setup] installing redis-server" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get install -y -qq redis-server >/dev/null 2>&1 || { $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq redis-server >/dev/null; }
  fi
fi

stamp="$VENV/.vime-setup"
want="$(cat pyproject.toml services/*/pyproject.toml scripts/setup.sh scripts/setup_deploy_tools.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -d "$VENV" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
LOG="$VENV/setup.log"
: > "$LOG"
# pip's own chatter (build-backend warnings of editable installs) goes to the log; on a failure
# the log's end is printed.
quiet() {
  echo "[setup] $*" >&2
  if ! "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "[setup] failed: $* (full log: $LOG)" >&2
    exit 1
  fi
}
quiet $PIP install -q --upgrade pip
# torch first, pinned to the CPU build that lies on this kind of machine's disk; on a GPU host
# the image already carries torch and this pin is not used.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  quiet $PIP install -q "torch==${VIME_TORCH_VERSION:-2.13.0}"
fi
extras=()
for svc in services/*/; do
  [ -f "$svc/pyproject.toml" ] && extras+=(-e "$svc")
done
quiet $PIP install -q -e ".[dev,models]" "${extras[@]}"
# Validators for the deployment checks (compose, hadolint, helm, Kubernetes schemas).
quiet env VIME_VENV="$VENV" bash scripts/setup_deploy_tools.sh
echo "$want" > "$stamp"
echo "[setup] ready: $VENV" >&2
