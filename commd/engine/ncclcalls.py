"""What NCCL is called with for each engine op, and how a launch makes those calls."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

from proto import DType, ErrorCode, ReduceOp

from ..errors import CallError
from .base import (
    AllGatherOp,
    AllReduceOp,
    BarrierOp,
    BroadcastOp,
    EngineOp,
    Order,
    RecvOp,
    ReduceScatterOp,
    Region,
    SendOp,
    TransferOp,
)
from .gpu import Gpu, GpuError
from .ncclmemory import NcclEvents, NcclRegion

Call = tuple[int, Callable[[int, int], None]]  # (local rank, the call given its communicator, stream)


def _moves_nothing(op: EngineOp) -> bool:
    """A collective whose every buffer is empty (a barrier is one on purpose)."""
    if isinstance(op, AllReduceOp | BroadcastOp):
        return all(region.nbytes == 0 for region in op.bufs.values())
    if isinstance(op, AllGatherOp | ReduceScatterOp):
        return all(region.nbytes == 0 for region in [*op.sends.values(), *op.recvs.values()])
    return False


def _ptr(region: Region) -> int:
    """A zero-byte span has no memory: NCCL takes a null pointer with a zero count."""
    return region.ptr if isinstance(region, NcclRegion) else 0


def bind(fn: Callable[..., None], *args: object) -> Callable[[int, int], None]:
    """A call with everything but the communicator and stream, which come last."""
    return lambda comm, stream: fn(*args, comm, stream)


def regions_of(op: EngineOp) -> list[NcclRegion]:
    found: list[object] = []
    if isinstance(op, AllReduceOp | BroadcastOp):
        found += op.bufs.values()
    elif isinstance(op, AllGatherOp | ReduceScatterOp):
        found += [*op.sends.values(), *op.recvs.values()]
    elif isinstance(op, TransferOp):
        found += [op.src, op.dst]
    elif isinstance(op, SendOp):
        found.append(op.src)
    elif isinstance(op, RecvOp):
        found.append(op.dst)
    return [r for r in found if isinstance(r, NcclRegion)]  # zero-byte spans carry no memory


def nccl_calls(gpu: Gpu, op: EngineOp, ranks: Sequence[int], scratch: Callable[[int], int],
               across_daemons: bool) -> list[Call]:
    """Each local rank's NCCL call for the op (in place where the op is); `scratch` gives
    a rank's byte of device memory (a barrier is a one-byte all_reduce)."""
    if across_daemons and _moves_nothing(op):
        # NCCL drops a collective of no bytes at once; across daemons the call must still
        # meet the other daemons' ranks (the world sends it here for that): a barrier's
        op = BarrierOp(tuple(ranks))
    if isinstance(op, AllReduceOp):
        return [(r, bind(gpu.all_reduce, _ptr(b), _ptr(b), b.nbytes // op.dtype.itemsize,
                         op.dtype, op.op)) for r, b in sorted(op.bufs.items())]
    if isinstance(op, AllGatherOp):
        return [(r, bind(gpu.all_gather, _ptr(op.sends[r]), _ptr(op.recvs[r]), op.sends[r].nbytes,
                         DType.U8)) for r in sorted(op.sends)]
    if isinstance(op, ReduceScatterOp):
        return [(r, bind(gpu.reduce_scatter, _ptr(op.sends[r]), _ptr(op.recvs[r]),
                         op.recvs[r].nbytes // op.dtype.itemsize, op.dtype, op.op))
                for r in sorted(op.sends)]
    if isinstance(op, BroadcastOp):
        return [(r, bind(gpu.broadcast, _ptr(b), _ptr(b), b.nbytes, DType.U8, op.root))
                for r, b in sorted(op.bufs.items())]
    if isinstance(op, BarrierOp):  # NCCL has none: a one-byte all_reduce meets every rank
        return [(r, bind(gpu.all_reduce, scratch(r), scratch(r), 1, DType.U8, ReduceOp.MAX))
                for r in sorted(set(op.ranks) & set(ranks))]
    if isinstance(op, TransferOp):
        return [(op.src_rank, bind(gpu.send, _ptr(op.src), op.src.nbytes, DType.U8, op.dst_rank)),
                (op.dst_rank, bind(gpu.recv, _ptr(op.dst), op.dst.nbytes, DType.U8, op.src_rank))]
    if isinstance(op, SendOp):
        return [(op.src_rank, bind(gpu.send, _ptr(op.src), op.src.nbytes, DType.U8, op.dst_rank))]
    assert isinstance(op, RecvOp)
    return [(op.dst_rank, bind(gpu.recv, _ptr(op.dst), op.dst.nbytes, DType.U8, op.src_rank))]


@contextlib.contextmanager
def nccl_group(gpu: Gpu) -> Iterator[None]:
    """ncclGroupStart, the body, ncclGroupEnd. When a call in the body failed, that error is
    the one told: the group end then fails too (NCCL ends a group with its members' error,
    or with its own at the half-made group) and would hide which call it was."""
    gpu.group_start()
    try:
        yield
    except BaseException:
        with contextlib.suppress(GpuError):
            gpu.group_end()
        raise
    gpu.group_end()


def launch(gpu: Gpu, entries: list[tuple[list[Call], Order | None]], comms: Mapping[int, int],
           streams: Mapping[int, int], devices: Mapping[int, int]) -> None:
    """Enqueue NCCL calls, all in one group, each behind its worker's ready event if it
    has one."""
    try:
        for calls, order in entries:
            if order is not None:
                for rank in {rank for rank, _ in calls}:
                    pair = order.events.get(rank)
                    if isinstance(pair, NcclEvents):
                        gpu.stream_wait_event(streams[rank], pair.ready)
        with nccl_group(gpu):
            for calls, _ in entries:
                for rank, call in calls:
                    gpu.use_device(devices[rank])
                    call(comms[rank], streams[rank])
    except GpuError as exc:
        raise CallError(ErrorCode.ENGINE, f"NCCL launch failed: {exc}") from None
