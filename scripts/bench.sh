#!/usr/bin/env bash
# DaemonBackend against torch.distributed gloo, side by side (installs torch CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh bench
exec .venv/bin/commd bench "$@"
