"""The daemon's bf16 add kernel, its very source, compiled for the CPU and checked bit for
bit against the host engine's arithmetic (the reference every engine is held to).

The CUDA source (commd.engine.addkernel.ADD_BF16_SOURCE) uses only CUDA's bit-cast
intrinsics and the grid indices; a prelude gives the C++ compiler those, with a grid
of one thread, so the grid-stride loop runs every element too. On a GPU, NVRTC
compiles the same text (scripts/gpu_check.sh compares its results with torch's).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from commd.engine.addkernel import ADD_BF16_SOURCE
from tests.integration.data import reduce_reference

pytestmark = pytest.mark.timeout(120)

_PRELUDE = b"""
#include <cstring>
#define __device__
#define __global__
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static const struct { unsigned x; } gridDim = {1}, blockDim = {1}, blockIdx = {0}, threadIdx = {0};
"""


@pytest.fixture(scope="module")
def add_on_cpu(tmp_path_factory: pytest.TempPathFactory) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    work = tmp_path_factory.mktemp("add-kernel")
    source, library = work / "add.cpp", work / "libadd.so"
    source.write_bytes(_PRELUDE + ADD_BF16_SOURCE)
    subprocess.run([compiler, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(library),
                    str(source)], check=True, timeout=120)
    kernel = ctypes.CDLL(str(Path(library))).commd_add_bf16
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]

    def add(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(dst, dtype=ml_dtypes.bfloat16).copy()
        other = np.ascontiguousarray(src, dtype=ml_dtypes.bfloat16)
        kernel(out.ctypes.data, other.ctypes.data, out.size)
        return out

    return add


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)  # NaN payloads may differ
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_random_bit_patterns_sum_as_the_host_engine_does(
        add_on_cpu: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    rng = np.random.default_rng(7)
    a = rng.integers(0, 1 << 16, 1 << 21, dtype=np.uint16).view(ml_dtypes.bfloat16)
    b = rng.integers(0, 1 << 16, 1 << 21, dtype=np.uint16).view(ml_dtypes.bfloat16)
    _assert_same(add_on_cpu(a, b), reduce_reference([a, b], "bf16", "sum"))


def test_edge_values_sum_as_the_host_engine_does(
        add_on_cpu: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    """Zeros of both signs, subnormals, the largest finite values (overflow to inf), the
    infinities, NaNs, and neighbours that round to even."""
    edges = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
                      0x7FC0, 0xFFC1, 0x3F80, 0x3F81, 0xBF80, 0x4B80, 0x3380, 0x3B80, 0xC000, 0x0100],
                     dtype=np.uint16)
    a = np.repeat(edges, edges.size).view(ml_dtypes.bfloat16)
    b = np.tile(edges, edges.size).view(ml_dtypes.bfloat16)
    _assert_same(add_on_cpu(a, b), reduce_reference([a, b], "bf16", "sum"))


def test_every_value_plus_a_rounding_neighbour(
        add_on_cpu: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    every = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    for step in (0x3B80, 0x3380, 0xBB80):  # 2**-8, 2**-24, -2**-8: sums that fall between values
        nudge = np.full(every.size, step, np.uint16).view(ml_dtypes.bfloat16)
        _assert_same(add_on_cpu(every, nudge), reduce_reference([every, nudge], "bf16", "sum"))
