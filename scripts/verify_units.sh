#!/usr/bin/env bash
# `systemd-analyze verify` on deploy/commd.service and deploy/commd.socket.
# verify insists that ExecStart's program exists, so it checks a copy whose ExecStart
# points at this checkout's .venv/bin/commd (run scripts/bootstrap.sh first). It only
# warns (exit 0) about unknown keys and bad values, so any output at all fails here.
# Without systemd-analyze, it installs systemd where it can (root with apt-get), else
# prints a SKIP line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v systemd-analyze >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing systemd (for systemd-analyze) ..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; } \
    >/dev/null 2>&1 || echo "could not install systemd" >&2
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIP: unit files not verified: systemd-analyze is not installed and could not be installed here"
  exit 0
fi
commd="$PWD/.venv/bin/commd"
[ -x "$commd" ] || { echo "verify_units: $commd missing: run scripts/bootstrap.sh first" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp deploy/commd.socket "$tmp/"
sed "s|^ExecStart=/opt/commd/venv/bin/commd |ExecStart=$commd |" deploy/commd.service > "$tmp/commd.service"
grep -q "^ExecStart=$commd " "$tmp/commd.service" \
  || { echo "verify_units: deploy/commd.service does not start /opt/commd/venv/bin/commd" >&2; exit 1; }
if ! out="$(cd "$tmp" && systemd-analyze verify --man=no commd.socket commd.service 2>&1)" || [ -n "$out" ]; then
  echo "$out"
  echo "FAIL: systemd-analyze verify found problems in deploy/commd.service or deploy/commd.socket" >&2
  exit 1
fi
echo "systemd-analyze verify: deploy/commd.service and deploy/commd.socket OK ($(systemd-analyze --version | head -1))"
