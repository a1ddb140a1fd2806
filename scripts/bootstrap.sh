#!/usr/bin/env bash
# Make .venv (Python >= 3.11) and install commd into it with the given extras.
# Reinstalls only when pyproject.toml changes, so repeated runs cost nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "commd needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=".venv/.commd-installed${extras:+-$extras}"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "installing commd${extras:+[$extras]} into .venv ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
  echo "$want" > "$stamp"
fi
