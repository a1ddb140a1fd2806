"""The host engine's arithmetic on its own: exact widening, one rounding, NaN rules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from commd.engine.hostreduce import NUMPY_DTYPE, SMALL_ELEMS, accumulate, accumulator, fold, reduce_range
from proto import DType, ReduceOp

pytestmark = pytest.mark.timeout(30)


def test_every_bf16_widens_exactly() -> None:
    """A bf16 is the top half of a float32: widening keeps every bit pattern, NaNs too."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    widened = accumulate([bits.view(np.uint8)], DType.BF16, ReduceOp.SUM, accumulator(DType.BF16, len(bits)))
    assert np.array_equal(widened.view(np.uint32), bits.astype(np.uint32) << 16)


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16])
def test_folding_a_half_width_float_computes_in_float32(dtype: DType, op: ReduceOp) -> None:
    """`fold` widens on the way into the float32 op: every one of the 65536 bit patterns
    against float32 accumulators (signed zeros, infinities, NaN, subnormal, huge) gives
    what widening first and then computing in float32 gives, to the bit."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    acc = np.random.default_rng(5).standard_normal(len(bits)).astype(np.float32) * np.float32(100)
    acc[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3e38, -3e38]
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply,
             ReduceOp.MIN: np.fmin, ReduceOp.MAX: np.fmax}[op]
    with np.errstate(all="ignore"):
        expected = ufunc(acc, bits.view(NUMPY_DTYPE[dtype]).astype(np.float32))
        folded = acc.copy()
        fold(folded, bits.view(np.uint8), dtype, op)
    assert np.array_equal(folded.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("elems", [SMALL_ELEMS // 2, 3 * (1 << 16) + 5])  # short path; chunked
def test_bf16_sums_round_once_after_float32_accumulation(elems: int) -> None:
    rng = np.random.default_rng(elems)
    srcs = [rng.standard_normal(elems).astype(ml_dtypes.bfloat16) for _ in range(3)]
    srcs[1][:4] = [np.inf, -np.inf, np.nan, 0]
    total = sum((s.astype(np.float32) for s in srcs[1:]), srcs[0].astype(np.float32))
    expected = total.astype(ml_dtypes.bfloat16)
    out = np.empty(elems, ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):
        reduce_range([s.view(np.uint8) for s in srcs], [out.view(np.uint8)], DType.BF16, ReduceOp.SUM)
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
