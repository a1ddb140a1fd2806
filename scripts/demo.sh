#!/usr/bin/env bash
# The main job: a daemon and 4 workers run a checked tensor-parallel decode loop.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/commd demo --ranks 4 "$@"
