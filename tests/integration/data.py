"""Deterministic per-rank inputs and the numpy references results are checked against."""

from __future__ import annotations

import ml_dtypes
import numpy as np

NUMPY = {
    "bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64,
    "i32": np.int32, "i64": np.int64, "u8": np.uint8,
}
UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.fmin, "max": np.fmax}  # NaN: as NCCL
FLOATS = ("bf16", "f16", "f32", "f64")


def make_input(seed: int, rank: int, nelem: int, dtype: str, op: str) -> np.ndarray:
    """Rank `rank`'s input: values chosen so products stay finite and sums exercise wrap-around."""
    rng = np.random.default_rng((seed, rank))
    if dtype in FLOATS:
        low, high = (0.5, 1.5) if op == "prod" else (-8.0, 8.0)
        return rng.uniform(low, high, nelem).astype(NUMPY[dtype])
    info = np.iinfo(NUMPY[dtype])
    if op == "prod":
        return rng.integers(-3 if info.min < 0 else 0, 4, nelem).astype(NUMPY[dtype])
    return rng.integers(info.min, info.max, nelem, endpoint=True, dtype=NUMPY[dtype])


def signed_zeros(rank: int, nelem: int, dtype: str) -> np.ndarray:
    """Rank `rank`'s zeros: element i is -0.0 where bit `rank` of i is set, else +0.0, so
    the first 2**n elements hold every way n ranks can hold the two (and NaN, on rank 0,
    every 7th element: passed over by min and max)."""
    index = np.arange(nelem)
    values = np.where((index >> rank) & 1, -0.0, 0.0)
    if rank == 0:
        values[index % 7 == 6] = np.nan
    return values.astype(NUMPY[dtype])


def signed_zeros_reference(n: int, nelem: int, dtype: str, op: str) -> np.ndarray:
    """min/max of n ranks' `signed_zeros`: -0.0 < +0.0 (min: -0.0 if any rank holds it;
    max: only if every rank that holds a number does), NaN only where every rank has one."""
    inputs = np.stack([signed_zeros(r, nelem, dtype).astype(np.float64) for r in range(n)])
    nan = np.isnan(inputs)
    negative = np.signbit(inputs) & ~nan
    sign = negative.any(axis=0) if op == "min" else (negative | nan).all(axis=0)
    return np.where(nan.all(axis=0), np.nan, np.where(sign, -0.0, 0.0)).astype(NUMPY[dtype])


def reduce_reference(inputs: list[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """The daemon's documented arithmetic: rank order; bf16/f16 accumulate in float32, round once."""
    ufunc = UFUNC[op]
    wide = dtype in ("bf16", "f16")
    acc = inputs[0].astype(np.float32) if wide else inputs[0].copy()
    with np.errstate(all="ignore"):
        for x in inputs[1:]:
            ufunc(acc, x.astype(np.float32) if wide else x, out=acc)
    return acc.astype(NUMPY[dtype]) if wide else acc


def grouped_reference(inputs: list[np.ndarray], dtype: str, op: str,
                      groups: list[list[int]]) -> np.ndarray:
    """The arithmetic across daemons: each daemon reduces its ranks in rank order (float32
    for bf16/f16); a member's partial is rounded to the element type for the wire; the
    root (the daemon of rank 0) adds them to its own in order of their lowest rank and
    rounds once."""
    ufunc = UFUNC[op]
    wide = dtype in ("bf16", "f16")
    partials = []
    for group in sorted(groups, key=min):
        acc = inputs[group[0]].astype(np.float32) if wide else inputs[group[0]].copy()
        with np.errstate(all="ignore"):
            for r in group[1:]:
                ufunc(acc, inputs[r].astype(np.float32) if wide else inputs[r], out=acc)
            if wide and 0 not in group:
                acc = acc.astype(NUMPY[dtype]).astype(np.float32)
        partials.append(acc)
    total = partials[0].copy()
    with np.errstate(all="ignore"):
        for part in partials[1:]:
            ufunc(total, part, out=total)
    return total.astype(NUMPY[dtype]) if wide else total
