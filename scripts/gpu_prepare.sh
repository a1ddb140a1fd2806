#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh carries to the GPU machine (which has no network):
# nccl4py, pytest-asyncio and cryptography (+ cffi, pycparser: two daemons seal their peer
# frames) wheels for its Python 3.12 in .whl/, with the pytest CI runs (pytest-asyncio 1.5
# needs pytest >= 8.4, and the image's version was never read; the contract step loads only
# these plugins), fallbacks for nccl4py's
# cuda-core/cuda-pathfinder pins in .whl/fallback/, and ../shared/gpu/probe.py in .probe/.
# Both folders are ignored by git (.git/info/exclude) and never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.probe/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
mkdir -p .probe .whl/fallback
cp ../shared/gpu/probe.py .probe/
py=$(command -v python3)
flags=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q "${flags[@]}" -d .whl nccl4py==0.6.0 pytest-asyncio==1.5.0 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==2.23 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0
"$py" -m pip download -q "${flags[@]}" -d .whl/fallback cuda-core==1.2.2 cuda-pathfinder==1.9.0
du -sh .whl .probe
ls .whl .whl/fallback
