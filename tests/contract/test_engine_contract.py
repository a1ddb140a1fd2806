"""The contract every engine passes (DESIGN §9.9): matched ops on engine-allocated memory.

Parametrized over engines; an engine this machine cannot run is skipped. Data
goes in and out through a small per-engine adapter (host: numpy views; a GPU
engine: device copies), so the cases themselves are engine-agnostic.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from commd.engine import create_engine
from commd.engine.base import (
    AllGatherOp,
    AllReduceOp,
    BarrierOp,
    BroadcastOp,
    Engine,
    MemoryMapping,
    ReduceScatterOp,
    Region,
    TransferOp,
)
from commd.engine.nccl import NcclEngine
from commd.errors import CallError, ConfigError
from proto import DType, ErrorCode, MemKind, ReduceOp
from tests.contract.fakegpu import FakeGpu
from tests.integration.data import make_input, reduce_reference

pytestmark = pytest.mark.timeout(60)


class HostAdapter:
    def write(self, region: Region, data: bytes) -> None:
        region.array[:] = np.frombuffer(data, np.uint8)  # type: ignore[attr-defined]

    def read(self, region: Region) -> bytes:
        return bytes(region.array)  # type: ignore[attr-defined]


class DeviceAdapter:
    """Device memory, through the NCCL engine's own seam (a real GPU or the fake)."""

    def __init__(self, engine: Any) -> None:
        self.gpu = engine.gpu

    def write(self, region: Region, data: bytes) -> None:
        self.gpu.copy_in(region.ptr, data)  # type: ignore[attr-defined]

    def read(self, region: Region) -> bytes:
        return bytes(self.gpu.copy_out(region.ptr, region.nbytes))  # type: ignore[attr-defined]


def adapter(engine: Engine) -> Any:
    return HostAdapter() if engine.name == "host" else DeviceAdapter(engine)


@pytest.fixture(params=["host", "nccl", "nccl-fake"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """`nccl-fake`: the NCCL engine's own logic over a stand-in for CUDA and NCCL."""
    if request.param == "nccl-fake":
        eng: Engine = NcclEngine(FakeGpu())
    else:
        try:
            eng = create_engine(request.param)
        except ConfigError as exc:
            pytest.skip(str(exc))
    yield eng
    eng.close()


class World:
    """Per-rank engine memory for one test."""

    def __init__(self, engine: Engine, n: int) -> None:
        self.engine, self.n = engine, n
        self.io = adapter(engine)
        self.mappings: list[MemoryMapping] = []

    def region(self, data: bytes, size: int | None = None) -> Region:
        size = size if size is not None else len(data)
        mapping, fd = self.engine.allocate(max(size, 1))
        os.close(fd)
        self.mappings.append(mapping)
        region = mapping.region(0, size)
        if data:
            self.io.write(region, data)
        return region

    def close(self) -> None:
        for m in self.mappings:
            m.close()


@pytest.fixture
def world4(engine: Engine) -> Iterator[World]:
    w = World(engine, 4)
    yield w
    w.close()


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("op", list(ReduceOp))
async def test_all_reduce(engine: Engine, world4: World, dtype: DType, op: ReduceOp) -> None:
    inputs = [make_input(3, r, 1027, dtype.value, op.value) for r in range(4)]
    bufs = {r: world4.region(x.tobytes()) for r, x in enumerate(inputs)}
    await engine.communicator("c", 1, 4, range(4)).run(AllReduceOp(bufs, dtype, op))
    want = reduce_reference(inputs, dtype.value, op.value).tobytes()
    assert all(world4.io.read(b) == want for b in bufs.values())


@pytest.mark.parametrize("nelem", [1, 65536 * 2 + 3, 3 * 1024 * 1024])
async def test_all_reduce_sizes_cross_the_inline_and_chunk_limits(engine: Engine, world4: World,
                                                                  nelem: int) -> None:
    inputs = [make_input(4, r, nelem, "bf16", "sum") for r in range(4)]
    bufs = {r: world4.region(x.tobytes()) for r, x in enumerate(inputs)}
    comm = engine.communicator("c", 1, 4, range(4))
    await comm.run(AllReduceOp(bufs, DType.BF16, ReduceOp.SUM))
    want = reduce_reference(inputs, "bf16", "sum").tobytes()
    assert all(world4.io.read(b) == want for b in bufs.values())


async def test_rank_order_decides_float_sums(engine: Engine, world4: World) -> None:
    inputs = [np.array([1e8, 1.0, -1e8, 3.0][r:] + [0.0] * r, np.float32) for r in range(4)]
    bufs = {r: world4.region(inputs[r].tobytes()) for r in (3, 1, 0, 2)}  # given out of order
    await engine.communicator("c", 1, 4, range(4)).run(AllReduceOp(bufs, DType.F32, ReduceOp.SUM))
    want = reduce_reference(inputs, "f32", "sum").tobytes()
    assert all(world4.io.read(b) == want for b in bufs.values())


async def test_all_gather(engine: Engine, world4: World) -> None:
    parts = [make_input(5, r, 1001, "u8", "sum").tobytes() for r in range(4)]
    sends = {r: world4.region(p) for r, p in enumerate(parts)}
    recvs = {r: world4.region(b"", 4 * 1001) for r in range(4)}
    await engine.communicator("c", 1, 4, range(4)).run(AllGatherOp(sends, recvs))
    assert all(world4.io.read(r) == b"".join(parts) for r in recvs.values())


@pytest.mark.parametrize("dtype,op", [(DType.U8, ReduceOp.SUM), (DType.BF16, ReduceOp.MAX),
                                      (DType.F64, ReduceOp.PROD)])
async def test_reduce_scatter(engine: Engine, world4: World, dtype: DType, op: ReduceOp) -> None:
    share = 700
    inputs = [make_input(6, r, share * 4, dtype.value, op.value) for r in range(4)]
    sends = {r: world4.region(x.tobytes()) for r, x in enumerate(inputs)}
    recvs = {r: world4.region(b"", share * dtype.itemsize) for r in range(4)}
    await engine.communicator("c", 1, 4, range(4)).run(ReduceScatterOp(sends, recvs, dtype, op))
    full = reduce_reference(inputs, dtype.value, op.value)
    for r, region in recvs.items():
        assert world4.io.read(region) == full[r * share:(r + 1) * share].tobytes()


@pytest.mark.parametrize("root", [0, 3])
async def test_broadcast(engine: Engine, world4: World, root: int) -> None:
    parts = [make_input(7, r, 5000, "u8", "sum").tobytes() for r in range(4)]
    bufs = {r: world4.region(p) for r, p in enumerate(parts)}
    await engine.communicator("c", 1, 4, range(4)).run(BroadcastOp(bufs, root))
    assert all(world4.io.read(b) == parts[root] for b in bufs.values())


async def test_transfer_and_barrier(engine: Engine, world4: World) -> None:
    payload = make_input(8, 0, 3000, "u8", "sum").tobytes()
    src, dst = world4.region(payload), world4.region(b"\x00" * 3000)
    comm = engine.communicator("c", 1, 4, range(4))
    await comm.run(TransferOp(1, src, 2, dst))
    await comm.run(BarrierOp((0, 1, 2, 3)))
    assert world4.io.read(dst) == payload


async def test_abort_fails_later_runs(engine: Engine, world4: World) -> None:
    bufs = {r: world4.region(b"\x01\x00" * 8) for r in range(4)}
    comm = engine.communicator("c", 1, 4, range(4))
    comm.abort()
    with pytest.raises(CallError) as info:
        await comm.run(AllReduceOp(bufs, DType.BF16, ReduceOp.SUM))
    assert info.value.code is ErrorCode.WORLD_FAILED


def test_regions_are_bounds_checked(engine: Engine) -> None:
    mapping, fd = engine.allocate(4096)
    os.close(fd)
    try:
        assert mapping.size == 4096
        assert mapping.region(4000, 96).nbytes == 96
        for offset, nbytes in [(4000, 97), (4096, 1), (1 << 50, 1)]:
            with pytest.raises(CallError) as info:
                mapping.region(offset, nbytes)
            assert info.value.code is ErrorCode.BAD_MEMORY
    finally:
        mapping.close()


def test_foreign_memory_kinds_are_refused(engine: Engine) -> None:
    for kind in MemKind:
        if kind in engine.memory_kinds:
            continue
        with pytest.raises(CallError) as info:
            engine.import_memory(kind, 64, b"\x00" * 64, None)
        assert info.value.code is ErrorCode.MISUSE
