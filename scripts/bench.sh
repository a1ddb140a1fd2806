#!/usr/bin/env bash
# DaemonBackend against torch.distributed gloo, side by side (installs torch 2.13.0 from PyPI
# unless that version is in .venv already; the README says how to keep it to the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh bench
exec .venv/bin/commd bench "$@"
