#!/usr/bin/env bash
# Run the fault-injection scenarios and print their table (detection, recovery, errors seen
# by an unrelated world, leaks). Detection: from the fault to the survivor's error;
# recovery: from that error (or the heal) to the first good call of the rebuilt world.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
out="$(mktemp -d)/faults.json"
FAULT_REPORT_JSON="$out" .venv/bin/pytest -q -p no:cacheprovider tests/fault \
  tests/integration/test_multi_daemon_faults.py \
  tests/integration/test_bad_input.py::test_mismatched_collectives >&2
exec .venv/bin/python -m tests.fault.report "$out"
