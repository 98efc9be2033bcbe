#!/usr/bin/env bash
# The GPU suite in one device call (scripts/gpu/suite.py has the details):
#   bash scripts/gpu/device.sh run bash scripts/gpu/suite.sh tests      # loop contract megatron
#   bash scripts/gpu/device.sh run bash scripts/gpu/suite.sh benches    # bench_sync bench_step
#   bash scripts/gpu/suite.sh --dry-run tests                           # CPU stand-ins, here
#   bash scripts/gpu/suite.sh --list
# Results: $OUT/results.json, $OUT/summary.md, $OUT/logs.tar.gz (rewritten after every step).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$HERE/suite.py" "$@"
