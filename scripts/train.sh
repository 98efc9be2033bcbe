#!/usr/bin/env bash
# The main job on a fresh machine: set up (scripts/setup.sh), then `vime train` with any
# arguments given. With no GPU this runs the embedded CPU default end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VIME_VENV:-.venv}"
exec "$VENV/bin/vime" train "$@"
