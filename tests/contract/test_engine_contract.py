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
    Communicator,
    Engine,
    MemoryMapping,
    ReduceScatterOp,
    Region,
    TransferOp,
)
from commd.engine.bindings import BindingsGpu
from commd.engine.nccl import NcclEngine
from commd.errors import CallError, ConfigError
from proto import DType, ErrorCode, MemKind, ReduceOp
from tests import fakecuda
from tests.contract.fakegpu import FakeGpu
from tests.integration.data import NUMPY, make_input, reduce_reference

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


@pytest.fixture(params=["host", "nccl", "nccl-fake", "nccl-abi"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """`nccl-fake`: the NCCL engine's own logic over a stand-in for CUDA and NCCL (two
    devices, so ranks spread over GPUs as on a real node). `nccl-abi`: the same stand-in
    behind the real cuda-bindings and nccl4py (tests/fakecuda), so the engine's calls
    into them run too."""
    fake = FakeGpu(devices=2, multi_rank_gpu=True)
    if request.param == "nccl-fake":
        eng: Engine = NcclEngine(fake)
    elif request.param == "nccl-abi":
        with fakecuda.bound(fake):
            eng = create_engine("auto")  # as `commd serve --engine auto` picks it, over the bindings
            assert isinstance(eng, NcclEngine) and isinstance(eng.gpu, BindingsGpu)
            yield eng
            eng.close()
        assert fake.violations == []  # nothing a GPU would not have let pass
        return
    else:
        try:
            eng = create_engine(request.param)
        except ConfigError as exc:
            pytest.skip(str(exc))
    yield eng
    eng.close()
    assert fake.violations == []


def ranks_per_gpu() -> int:
    """Two ranks of one communicator on one GPU need NCCL >= 2.30 with
    NCCL_MULTI_RANK_GPU_ENABLE=1 (scripts/gpu_check.sh sets it); else one per GPU."""
    from nccl.bindings import nccl

    allowed = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" and int(nccl.get_version()) >= 23000
    return 2 if allowed else 1


class World:
    """The ranks of one test, their devices, and their engine memory. Four ranks, but on
    real GPUs at most two per GPU, and one unless NCCL allows more (below)."""

    def __init__(self, engine: Engine, real_gpu: bool) -> None:
        self.engine = engine
        gpus = engine.gpu.device_count() if isinstance(engine, NcclEngine) else 1
        self.n = min(4, ranks_per_gpu() * gpus) if real_gpu else 4
        self.devices = {r: r % gpus for r in range(self.n)}
        self.io = adapter(engine)
        self.mappings: list[MemoryMapping] = []
        self.comms: list[Communicator] = []

    def region(self, data: bytes, size: int | None = None, rank: int = 0) -> Region:
        size = size if size is not None else len(data)
        mapping, fd = self.engine.allocate(max(size, 1), self.devices[rank])
        os.close(fd)
        self.mappings.append(mapping)
        region = mapping.region(0, size)
        if data:
            self.io.write(region, data)
        return region

    def communicator(self) -> Communicator:
        comm = self.engine.communicator("c", 1, self.n, range(self.n), None, devices=self.devices)
        self.comms.append(comm)
        return comm

    def close(self) -> None:
        # a real GPU's communicators hold channel buffers and proxy threads until destroyed:
        # ~50 tests' worth would pile up in one contract run
        for comm in self.comms:
            comm.abort()
        for m in self.mappings:
            m.close()


@pytest.fixture
def world(engine: Engine, request: pytest.FixtureRequest) -> Iterator[World]:
    w = World(engine, real_gpu=request.node.callspec.params.get("engine") == "nccl")
    yield w
    w.close()


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("op", list(ReduceOp))
async def test_all_reduce(engine: Engine, world: World, dtype: DType, op: ReduceOp) -> None:
    inputs = [make_input(3, r, 1027, dtype.value, op.value) for r in range(world.n)]
    bufs = {r: world.region(x.tobytes(), rank=r) for r, x in enumerate(inputs)}
    await world.communicator().run(AllReduceOp(bufs, dtype, op))
    want = reduce_reference(inputs, dtype.value, op.value).tobytes()
    assert all(world.io.read(b) == want for b in bufs.values())


@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16, DType.F32, DType.F64])
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
async def test_min_and_max_pass_over_a_nan(engine: Engine, world: World, dtype: DType, op: ReduceOp) -> None:
    """As NCCL's kernels (fminf/fmaxf, __hmin/__hmax): a NaN on some ranks is passed over,
    and the result is NaN only where every rank has one."""
    n, numpy_type = world.n, NUMPY[dtype.value]
    values = np.arange(4 * (n + 1) * n, dtype=np.float64).reshape(n, -1) - 7.0
    values[np.arange(values.shape[1]) % (n + 1) == np.arange(n)[:, None]] = np.nan  # rank r: a NaN each n+1
    values[:, -1] = np.nan  # and everywhere
    inputs = [row.astype(numpy_type) for row in values]
    bufs = {r: world.region(x.tobytes(), rank=r) for r, x in enumerate(inputs)}
    await world.communicator().run(AllReduceOp(bufs, dtype, op))
    pick = np.fmin if op is ReduceOp.MIN else np.fmax
    want = pick.reduce(np.stack([x.astype(np.float64) for x in inputs]), axis=0)
    assert np.isnan(want).sum() == (1 if n > 1 else len(want) // (n + 1) + 1)
    for b in bufs.values():
        got = np.frombuffer(world.io.read(b), numpy_type).astype(np.float64)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("nelem", [1, 65536 * 2 + 3, 3 * 1024 * 1024])
async def test_all_reduce_sizes_cross_the_inline_and_chunk_limits(engine: Engine, world: World,
                                                                  nelem: int) -> None:
    inputs = [make_input(4, r, nelem, "bf16", "sum") for r in range(world.n)]
    bufs = {r: world.region(x.tobytes(), rank=r) for r, x in enumerate(inputs)}
    comm = world.communicator()
    await comm.run(AllReduceOp(bufs, DType.BF16, ReduceOp.SUM))
    want = reduce_reference(inputs, "bf16", "sum").tobytes()
    assert all(world.io.read(b) == want for b in bufs.values())


async def test_rank_order_decides_float_sums(engine: Engine, world: World) -> None:
    inputs = [np.array([1e8, 1.0, -1e8, 3.0][r:] + [0.0] * r, np.float32) for r in range(world.n)]
    order = [*range(1, world.n, 2), *range(0, world.n, 2)]  # given out of order
    bufs = {r: world.region(inputs[r].tobytes(), rank=r) for r in order}
    await world.communicator().run(AllReduceOp(bufs, DType.F32, ReduceOp.SUM))
    want = reduce_reference(inputs, "f32", "sum").tobytes()
    assert all(world.io.read(b) == want for b in bufs.values())


async def test_all_gather(engine: Engine, world: World) -> None:
    parts = [make_input(5, r, 1001, "u8", "sum").tobytes() for r in range(world.n)]
    sends = {r: world.region(p, rank=r) for r, p in enumerate(parts)}
    recvs = {r: world.region(b"", world.n * 1001, rank=r) for r in range(world.n)}
    await world.communicator().run(AllGatherOp(sends, recvs))
    assert all(world.io.read(r) == b"".join(parts) for r in recvs.values())


@pytest.mark.parametrize("dtype,op", [(DType.U8, ReduceOp.SUM), (DType.BF16, ReduceOp.MAX),
                                      (DType.F64, ReduceOp.PROD)])
async def test_reduce_scatter(engine: Engine, world: World, dtype: DType, op: ReduceOp) -> None:
    share = 700
    inputs = [make_input(6, r, share * world.n, dtype.value, op.value) for r in range(world.n)]
    sends = {r: world.region(x.tobytes(), rank=r) for r, x in enumerate(inputs)}
    recvs = {r: world.region(b"", share * dtype.itemsize, rank=r) for r in range(world.n)}
    await world.communicator().run(ReduceScatterOp(sends, recvs, dtype, op))
    full = reduce_reference(inputs, dtype.value, op.value)
    for r, region in recvs.items():
        assert world.io.read(region) == full[r * share:(r + 1) * share].tobytes()


@pytest.mark.parametrize("last", [False, True])
async def test_broadcast(engine: Engine, world: World, last: bool) -> None:
    root = world.n - 1 if last else 0
    parts = [make_input(7, r, 5000, "u8", "sum").tobytes() for r in range(world.n)]
    bufs = {r: world.region(p, rank=r) for r, p in enumerate(parts)}
    await world.communicator().run(BroadcastOp(bufs, root))
    assert all(world.io.read(b) == parts[root] for b in bufs.values())


async def test_transfer_and_barrier(engine: Engine, world: World) -> None:
    if world.n < 2:
        pytest.skip("one rank (one GPU, no NCCL_MULTI_RANK_GPU_ENABLE): no peer to send to")
    payload = make_input(8, 0, 3000, "u8", "sum").tobytes()
    src, dst = world.region(payload, rank=1), world.region(b"\x00" * 3000, rank=0)
    comm = world.communicator()
    await comm.run(TransferOp(1, src, 0, dst))
    await comm.run(BarrierOp(tuple(range(world.n))))
    assert world.io.read(dst) == payload


async def test_abort_fails_later_runs(engine: Engine, world: World) -> None:
    bufs = {r: world.region(b"\x01\x00" * 8, rank=r) for r in range(world.n)}
    comm = world.communicator()
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
