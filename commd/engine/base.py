"""The one interface every engine implements (host.py, nccl.py).

The daemon matches calls across ranks; an engine only runs fully matched ops on
memory it imported. Ops name buffers per rank (`dict[rank, Region]`) and hold
only the ranks local to this daemon, which is what a multi-node NCCL engine
needs too. Nothing outside `commd/engine/` imports CUDA or NCCL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from proto import DType, ErrorCode, MemKind, ReduceOp

from ..errors import CallError

if TYPE_CHECKING:
    from ..cluster import WorldNet


class StillOnDevice(CallError):
    """An op that failed (its communicator was aborted) while some of its ranks' streams
    had yet to get past it: `past[rank]` is done once that rank's stream is. Until then
    the op may still touch the rank's memory, so each rank's call is answered then, and
    not held by another rank's stream that may never get there."""

    def __init__(self, code: ErrorCode, message: str, past: Mapping[int, asyncio.Future[None]]) -> None:
        super().__init__(code, message)
        self.past = past


class Region(Protocol):
    """A bounds-checked window of imported memory (engine-specific)."""

    @property
    def nbytes(self) -> int: ...


class EmptyRegion:
    """Zero bytes of no buffer: a call with nothing to move that still has to meet its
    peers on other daemons (a sync point, and a call to compare for mismatches)."""

    nbytes = 0


EMPTY = EmptyRegion()


class MemoryMapping(Protocol):
    """One imported (or daemon-allocated) allocation."""

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> int | None:
        """The GPU the memory lives on (None: host memory)."""
        ...

    def region(self, offset: int, nbytes: int) -> Region:
        """The window [offset, offset+nbytes); raises CallError(BAD_MEMORY) outside."""
        ...

    def close(self, on_released: Callable[[], None] | None = None,
              on_let_go: Callable[[], None] | None = None) -> None:
        """Let it go; `on_released` runs once the memory is really unmapped, which an op
        still using it (one in flight, or a call waiting for its match) defers;
        `on_let_go` once no op uses it, which may be before (its unmap takes time)."""
        ...


@dataclass(frozen=True, slots=True)
class CallTag:
    """Which call an op is, across daemons: its index (among collectives, or on its
    (src, dst) pair for p2p) and its canonical form, compared for mismatches."""

    index: int = 0
    fingerprint: str = ""


NO_TAG = CallTag()


@dataclass(frozen=True, slots=True)
class AllReduceOp:
    bufs: Mapping[int, Region]
    dtype: DType
    op: ReduceOp
    tag: CallTag = NO_TAG


@dataclass(frozen=True, slots=True)
class AllGatherOp:
    sends: Mapping[int, Region]
    recvs: Mapping[int, Region]  # each world_size × the send size, in rank order
    tag: CallTag = NO_TAG


@dataclass(frozen=True, slots=True)
class ReduceScatterOp:
    sends: Mapping[int, Region]  # each world_size × the share
    recvs: Mapping[int, Region]
    dtype: DType
    op: ReduceOp
    tag: CallTag = NO_TAG


@dataclass(frozen=True, slots=True)
class BroadcastOp:
    bufs: Mapping[int, Region]
    root: int
    tag: CallTag = NO_TAG


@dataclass(frozen=True, slots=True)
class BarrierOp:
    ranks: Sequence[int]
    tag: CallTag = NO_TAG


@dataclass(frozen=True, slots=True)
class TransferOp:
    """A matched send/recv pair. On one node both sides are local."""

    src_rank: int
    src: Region
    dst_rank: int
    dst: Region


@dataclass(frozen=True, slots=True)
class SendOp:
    """The local half of a send whose receiver is on another daemon."""

    src_rank: int
    dst_rank: int
    src: Region
    tag: CallTag


@dataclass(frozen=True, slots=True)
class RecvOp:
    """The local half of a receive whose sender is on another daemon."""

    src_rank: int
    dst_rank: int
    dst: Region
    tag: CallTag


EngineOp = (AllReduceOp | AllGatherOp | ReduceScatterOp | BroadcastOp | BarrierOp | TransferOp
            | SendOp | RecvOp)


def op_nbytes(op: EngineOp) -> int:
    """Bytes the op touches on one rank: decides whether it may run on the event loop."""
    if isinstance(op, TransferOp | SendOp):
        return op.src.nbytes
    if isinstance(op, RecvOp):
        return op.dst.nbytes
    if isinstance(op, BarrierOp):
        return 0
    bufs = op.recvs if isinstance(op, AllGatherOp) else (
        op.sends if isinstance(op, ReduceScatterOp) else op.bufs
    )
    return max((r.nbytes for r in bufs.values()), default=0)


class EventPair(Protocol):
    """A worker's ready/done events, opened by the engine (see `proto.StreamEvents`)."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Order:
    """How an op is ordered with its workers' streams (host memory has none)."""

    events: Mapping[int, EventPair]  # local rank -> its worker's events for this call
    early: bool = False  # answer the op's calls once it is ordered on the device, not done


class Communicator(Protocol):
    """One world's communicator for one epoch, over the ranks local to this daemon."""

    # True: run() puts ops on the device in the order it is called (NCCL: a stream per
    # rank), so the world starts them as they match, without its own queue. The world's
    # queue would let sends and receives overtake collectives waiting in it, and a
    # device would then run them in another order than the peers' (a deadlock).
    launches_in_order: bool
    # False: async_error never reports anything (every op reports its own failure), so an
    # idle world need not poll it: its watchdog then sleeps until a call opens.
    reports_async_errors: bool

    def try_inline(self, op: EngineOp) -> bool:
        """Run a small op right now on the caller's thread and return True, or return
        False (nothing done) if it must go through `run`. Saves a task hop per small call."""
        ...

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        """Run one matched op to completion, or with `order.early` until it is ordered on
        the device (a later failure is then an `async_error`); raises CallError.

        `requests` names the client requests the op's calls came in (a worker's group is
        one request): an engine that hands the device several ops at once joins only ops
        that share one, as the workers grouped them (NCCL's rule, see ncclbatch.Batcher.launch_soon)."""
        ...

    def abort(self) -> None:
        """Stop using the communicator; pending and later runs fail."""
        ...

    def use_add_kernel(self, ranks: frozenset[int]) -> None:
        """The ranks here that called set_add_kernel. Once every rank of a 2-rank world
        did, a GPU engine may sum bf16 by exchanging buffers and adding them with its own
        kernel (the seed's NcclBackend path). Engines without one ignore it."""
        ...

    def register(self, rank: int, key: int, region: Region) -> None:
        """Register a rank's memory with the engine under `key` (NCCL's ncclCommRegister,
        for the memory NCCL registers safely); best effort: unregistered memory works the same."""
        ...

    def deregister(self, rank: int, key: int) -> None: ...

    def busy(self) -> bool:
        """Ops it answered early are still running (a GPU engine's async calls)."""
        ...

    def async_error(self) -> str | None:
        """A failure the engine found outside any one call (NCCL's `ncclCommGetAsyncError`:
        a remote rank's error, a network failure), or None while healthy. Polled by the
        world's watchdog, so it must be cheap and must not block."""
        ...


class Engine(Protocol):
    name: str
    memory_kinds: frozenset[MemKind]

    def import_memory(self, kind: MemKind, size: int, handle: bytes, fd: int | None,
                      device: int | None = None) -> MemoryMapping:
        """Open a worker's allocation (for `device`, the rank's GPU); `fd` stays the
        caller's (a client's may be anything: closing it may wait, see FdCloser).
        CallError on refusal."""
        ...

    def import_events(self, ready: bytes, done: bytes, device: int | None = None) -> EventPair:
        """Open a worker's interprocess events; CallError(MISUSE) from an engine without
        streams."""
        ...

    def allocate(self, nbytes: int, device: int | None = None) -> tuple[MemoryMapping, int]:
        """Allocate `nbytes` (on `device`, for a GPU engine) to share with a worker: the
        mapping and an fd to send it."""
        ...

    def communicator(self, world: str, epoch: int, world_size: int, local_ranks: Sequence[int],
                     net: WorldNet | None, *, devices: Mapping[int, int] | None = None,
                     unique_id: bytes = b"") -> Communicator:
        """`net` is None when every rank is here; otherwise the engine reaches the other
        daemons of the world through it (the host engine moves data over it; NCCL does not).
        `devices`: each local rank's GPU (from its hello). `unique_id`: the root's
        `unique_id()` for a world across daemons, empty when every rank is here."""
        ...

    def unique_id(self) -> bytes:
        """What the root hands every daemon of a new world to build its communicators
        from (NCCL's ncclUniqueId); empty for engines that need none."""
        ...

    def broken(self) -> str | None:
        """Why the engine can serve no more (its GPU's context failed for good), or None:
        the daemon then exits, for its service manager to start it afresh."""
        ...

    def describe(self) -> str:
        """One line for logs and `commd status`: the engine, what it runs on, and what
        holds its work up now, if anything (a running ncclCommAbort, say)."""
        ...

    def device_of(self, uuid: bytes) -> int | None:
        """This daemon's ordinal of the GPU with CUDA UUID `uuid` (a worker's ordinal of it
        may differ: CUDA_VISIBLE_DEVICES renumbers); None for engines without GPUs.
        CallError (misuse) for a GPU this daemon does not see."""
        ...

    def check_device(self, device: int) -> None:
        """CallError (misuse) for a GPU ordinal this daemon does not have (a world with such
        a rank would fail its communicators' init for every rank); engines without GPUs
        take any."""
        ...

    def on_loop_stall(self, announce: Callable[[float], None]) -> None:
        """Call `announce(limit_s)` right before the event loop may wait up to `limit_s`
        (a NCCL call waiting for an ncclCommAbort to return): the daemon tells its peers,
        whose links would otherwise time out and fail every world across them."""
        ...

    def close(self) -> None: ...


__all__ = [
    "EMPTY", "NO_TAG", "AllGatherOp", "AllReduceOp", "BarrierOp", "BroadcastOp", "CallError", "CallTag",
    "Communicator", "Engine", "EngineOp", "EventPair", "MemoryMapping", "Order", "RecvOp",
    "ReduceScatterOp", "Region", "SendOp", "TransferOp", "op_nbytes",
]
