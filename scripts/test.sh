#!/usr/bin/env bash
# Run vime's checks on a fresh machine: set up (scripts/setup.sh), lint, type-check, then the
# test suite (unit, contract against the reference engine, integration with real Redis and
# real service processes, deployment checks). GPU tests skip themselves without a GPU.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VIME_VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
echo "== ruff" && ruff check vime services tests bench
echo "== ruff format" && ruff format --check vime services tests bench
echo "== mypy" && mypy
echo "== pytest"
exec python -m pytest -q -ra --durations=25 "$@"
