#!/usr/bin/env bash
# The whole test suite: lint, types, then unit, contract and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
.venv/bin/ruff check proto commd client tests
.venv/bin/mypy
exec .venv/bin/pytest -q "$@"
