#!/usr/bin/env bash
# The GPU proof of issue 5 in ONE device call. From a session that has a GPU (device `status`:
# can_start_another true), after `ls .whl/*.whl .probe/probe.py` shows both here:
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".probe"], timeout_s=480)
#
# Expect ~5-6 min when things work (probe at most 90 s, contract suite ~1-2 min); 480 s is the cap
# (the issue asks for under 8 minutes), and the script keeps to GPU_CHECK_BUDGET (460 s) so the
# table always prints. Count on ONE run: the machine goes back 30 s after a call, a fresh one takes
# 1-2 min of the 15 and starts only with 4 min left. Call give_back at once unless a short rerun of
# the failed steps follows at once and `status` still shows budget_left_s > 300, e.g.
#   run(command="GPU_CHECK_BUDGET=150 bash scripts/gpu_check.sh --skip-probe --only 4,5",
#       carry=[".whl", ".probe"], timeout_s=170) Results come back in $OUT: gpu_check.log (this whole output), gpu_check.json,
# probe.json, daemons.log; the table is the end of the output. Copy it into docs/gpu-results.md.
#
# Preparing .whl and .probe (ignored through .git/info/exclude, never committed): run
# scripts/gpu_prepare.sh, which does this:
#   echo /.whl/ >> .git/info/exclude; echo /.probe/ >> .git/info/exclude
#   mkdir -p .probe && cp ../shared/gpu/probe.py .probe/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl nccl4py==0.6.0 pytest-asyncio==1.5.0 \
#     cryptography==50.0.2 cffi==2.1.1 pycparser==2.23   (peer frames between two daemons are sealed)
#     pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0   (the runner CI uses)
#   python3 -m pip download ...same flags... -d .whl/fallback cuda-core==1.2.2 cuda-pathfinder==1.9.0
#   (.whl/fallback is installed only when the machine's cuda-core/cuda-pathfinder miss nccl4py's pins)
#
# Without a GPU (the harness on the host engine, no wheels, no probe; its workers need torch, and a
# CPU build is enough: .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu):
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --dry-run
# Arguments go to scripts/gpu_check.py (--skip-probe, --only 3,4, --force-mode two-daemons, --budget S).
# GPU_CHECK_BUDGET (default 460) is the seconds from this script's start to the table; GPU_CHECK_TMP
# (default /tmp) holds the sockets and logs of the run; GPU_CHECK_BREAK=<check name> makes the last
# rank fail that check on its own (a self-test of the harness's recovery).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-460}
DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done
[ "${COMMD_GPU_CHECK_DRY:-0}" = 1 ] && DRY=1
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; LOG="$OUT/gpu_check.log"; else LOG=/dev/null; fi
export GPU_CHECK_LOG_TEED=1 PYTHONUNBUFFERED=1

main() {
  echo "gpu_check.sh: $(date -u +%FT%TZ) $(uname -n) $($PY -V 2>&1) at $(command -v "$PY")"
  if [ "$DRY" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    # the carried wheels (nccl4py, pytest and its plugins, cryptography and cffi), without the network
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || echo "gpu_check.sh: wheel install FAILED"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # nccl4py pins cuda-core~=1.0, cuda-pathfinder>=1.5.4: install the carried ones only if the image misses them
    unmet=$($PY - <<'EOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
    for text in md.requires("nccl4py") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            ok = req.specifier.contains(md.version(req.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            print(req.name, end=" ")
except Exception as exc:
    print("check-failed:", exc)
EOF
)
    echo "gpu_check.sh: nccl4py requirements the image misses: ${unmet:-none}"
    if [ -n "$unmet" ] && [ "${unmet#check-failed}" = "$unmet" ] && ls .whl/fallback/*.whl >/dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/fallback/*.whl || echo "gpu_check.sh: fallback wheel install FAILED"
    fi
    # libnccl from the image's nvidia-nccl-cu13 wheel, for nccl4py's dlopen fallback
    nccl_lib=$($PY -c "import glob, os, site
for d in site.getsitepackages():
    hits = glob.glob(os.path.join(d, 'nvidia', '**', 'libnccl.so*'), recursive=True)
    if hits:
        print(os.path.dirname(hits[0]))
        break" 2>/dev/null)
    [ -n "$nccl_lib" ] && export LD_LIBRARY_PATH=$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "gpu_check.sh: libnccl dir: ${nccl_lib:-not found}"
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  # step 0 of gpu_check.py runs .probe/probe.py (unless --skip-probe), inside the same budget
  $PY scripts/gpu_check.py --budget $((BUDGET - SECONDS)) "$@"
}

main "$@" 2>&1 | tee "$LOG"
