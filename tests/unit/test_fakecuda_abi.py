"""The stand-in driver's C side (tests/fakecuda/fakecuda.c) against the real cuda.h.

The stand-in writes the driver's types out itself, so that CI machines need no CUDA
headers. Where a CUDA toolkit is installed, the compiler compares every driver
function it defines with cuda.h's prototype: a wrong argument type or count, or a
function defined under the wrong versioned name, fails to compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import fakecuda

pytestmark = pytest.mark.timeout(120)


def _cuda_include() -> Path | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda.h").exists():
            return Path(root) / "include"
    return None


def test_the_driver_functions_match_cuda_h(tmp_path: Path) -> None:
    include, compiler = _cuda_include(), shutil.which("cc") or shutil.which("gcc")
    if include is None or compiler is None:
        pytest.skip("no CUDA toolkit headers (cuda.h) or no C compiler here")
    done = subprocess.run([compiler, *fakecuda.COMPILE_FLAGS, "-DCOMMD_FAKE_CHECK_HEADERS", f"-I{include}",
                           "-o", str(tmp_path / "check.so"), str(fakecuda.SOURCE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_wrong_prototype_is_caught(tmp_path: Path) -> None:
    """The check above can fail: the same build of a copy with one argument's type wrong."""
    include, compiler = _cuda_include(), shutil.which("cc") or shutil.which("gcc")
    if include is None or compiler is None:
        pytest.skip("no CUDA toolkit headers (cuda.h) or no C compiler here")
    broken = tmp_path / "broken.c"
    source = fakecuda.SOURCE.read_text()
    right = "CUresult cuMemFree_v2(CUdeviceptr ptr)"
    assert right in source
    broken.write_text(source.replace(right, "CUresult cuMemFree_v2(int ptr)"))
    done = subprocess.run([compiler, *fakecuda.COMPILE_FLAGS, "-DCOMMD_FAKE_CHECK_HEADERS", f"-I{include}",
                           "-o", str(tmp_path / "broken.so"), str(broken)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "cuMemFree_v2" in done.stderr
