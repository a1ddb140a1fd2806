"""The host engine: workers' memfd-backed memory, mapped here, moved by the CPU.

A complete engine for machines without GPUs and for tests (DESIGN §6). Memory
arrives as a memfd over SCM_RIGHTS (see hostmemory). Ops bigger than `inline_bytes`
run on a thread pool, cut into ranges, so the event loop stays free for heartbeats
and small calls. Smaller ones
run on the loop within a budget per turn of it (`InlineBudget`); past it they
wait, in order, for a later turn (a group of hundreds of small ops, all matched
in one turn, would otherwise hold the loop for all of them).
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from proto import ErrorCode, MemKind

from ..errors import CallError
from .base import (
    EMPTY,
    AllGatherOp,
    AllReduceOp,
    BarrierOp,
    BroadcastOp,
    EngineOp,
    EventPair,
    Order,
    ReduceScatterOp,
    Region,
    TransferOp,
    op_nbytes,
)
from .hostmemory import HostMapping, HostRegion, Unmapper, create_memfd, open_files_hint
from .hostnet import NetRunner, off_loop
from .hostreduce import CHUNK_ELEMS, quiet_float_errors, reduce_range, split

if TYPE_CHECKING:
    from ..cluster import WorldNet

Job = Callable[[], None]
# The most output one job of an op writes. Every world's ops share the pool, which runs jobs
# in the order they came: another world's op waits for the jobs ahead of it, so a large op
# cut into few jobs (one per thread) held every other world's ops for about as long as it
# ran itself (a 64 MiB all_reduce held 256 KiB ones of another world up to 30 ms).
_JOB_BYTES = 4 << 20


def _crosses(op: EngineOp) -> bool:
    """Whether the op involves ranks of other daemons (every collective does, in a world
    that spans daemons; a local send/recv pair does not)."""
    return not isinstance(op, TransferOp)


def _arr(region: Region) -> np.ndarray:
    if region is EMPTY:
        return np.zeros(0, np.uint8)
    if not isinstance(region, HostRegion):
        raise CallError(ErrorCode.INTERNAL, f"host engine got a {type(region).__name__} region")
    return region.array


def _plan(op: EngineOp, parts: int, most: int | None = None) -> list[Job]:
    """Cut an op into independent jobs that touch disjoint output bytes: its reductions
    into `parts` ranges at least, and every job to at most `most` bytes of output."""
    def pieces(nbytes: int, at_least: int = 1) -> int:
        return max(at_least, -(-nbytes // most) if most else 1)

    if isinstance(op, AllReduceOp):
        arrays = [_arr(op.bufs[rank]) for rank in sorted(op.bufs)]  # rank order fixes the float sum
        align = CHUNK_ELEMS * op.dtype.itemsize
        jobs = []
        for lo, hi in split(len(arrays[0]), pieces(len(arrays[0]), parts), align):
            ranges = [a[lo:hi] for a in arrays]
            jobs.append(_bind_reduce(ranges, ranges, op))  # (in place: reduce_range reads all first)
        return jobs
    if isinstance(op, ReduceScatterOp):
        sends = [_arr(op.sends[r]) for r in sorted(op.sends)]
        align = CHUNK_ELEMS * op.dtype.itemsize
        jobs = []
        for rank, recv in op.recvs.items():
            out = _arr(recv)
            base = rank * len(out)
            for lo, hi in split(len(out), pieces(len(out), parts // len(op.recvs)), align):
                jobs.append(_bind_reduce([s[base + lo:base + hi] for s in sends], [out[lo:hi]], op))
        return jobs
    if isinstance(op, AllGatherOp):
        jobs = []
        for recv in op.recvs.values():
            out = _arr(recv)
            for src_rank, send in op.sends.items():
                size = send.nbytes
                jobs += _copies(out[src_rank * size:(src_rank + 1) * size], _arr(send), pieces(size))
        return jobs
    if isinstance(op, BroadcastOp):
        source = _arr(op.bufs[op.root])
        return [job for rank, r in op.bufs.items() if rank != op.root
                for job in _copies(_arr(r), source, pieces(source.nbytes))]
    if isinstance(op, TransferOp):
        return _copies(_arr(op.dst), _arr(op.src), pieces(op.src.nbytes))
    if isinstance(op, BarrierOp):
        return []  # matching every rank's call is the barrier
    raise CallError(ErrorCode.INTERNAL, f"host engine cannot run {type(op).__name__}")


def _bind_reduce(srcs: list[np.ndarray], dsts: list[np.ndarray],
                 op: AllReduceOp | ReduceScatterOp) -> Job:
    return lambda: reduce_range(srcs, dsts, op.dtype, op.op)


def _bind_copy(dst: np.ndarray, src: np.ndarray) -> Job:
    def copy() -> None:
        dst[...] = src
    return copy


def _copies(dst: np.ndarray, src: np.ndarray, parts: int) -> list[Job]:
    return [_bind_copy(dst[lo:hi], src[lo:hi]) for lo, hi in split(len(src), parts, 1)]


async def _in_turns(pool: ThreadPoolExecutor, jobs: list[Job], width: int) -> None:
    """Run `jobs` on the pool, at most `width` of them there at once: the next is handed
    over as one ends, so another world's op, handed over meanwhile, runs after the jobs
    already there, not after all of this op's."""
    left = iter(jobs)

    async def lane() -> None:
        for job in left:  # (the lanes share the iterator: each takes the next job)
            await off_loop(pool, job)

    await asyncio.gather(*(lane() for _ in range(min(width, len(jobs)))))


class InlineBudget:
    """The bytes of small ops the event loop's thread may run inline in one turn of the
    loop, for every world together; past it, an op waits, in the order it came, for a
    later turn.
    The budget starts afresh in the turn after half of it was spent: a refill every turn
    would cost a callback per small op, and none until it ran out would make every 64th
    lone small call wait a turn."""

    def __init__(self, op_bytes: int, turn_bytes: int, op_cost: int = 16 << 10) -> None:
        self._op_bytes = op_bytes
        self._turn_bytes = turn_bytes
        # the least an op costs, in bytes: its bookkeeping takes about as long as summing
        # 16 KiB, so hundreds of barriers are no free ride either
        self._op_cost = op_cost
        self._spent = 0
        self._refilling = False
        # small ops that found no room, in the order they came: the next turn's refill runs
        # them before that turn's newcomers (which would otherwise take the room each turn)
        self._waiting: collections.deque[tuple[int, Callable[[], None], asyncio.Future[None]]] = (
            collections.deque())

    def small(self, nbytes: int) -> bool:
        """Whether an op of `nbytes` runs inline at all (else on the pool's threads)."""
        return nbytes <= self._op_bytes

    def take(self, nbytes: int) -> bool:
        """Whether a small op may run inline now (if not, a later turn has room for it)."""
        if self._waiting:  # (those waiting go first)
            return False
        cost = self._cost(nbytes)
        if not self._has_room(cost):
            self._refill_next_turn()
            return False
        self._spent += cost
        if self._spent > self._turn_bytes // 2:
            self._refill_next_turn()
        return True

    async def run(self, nbytes: int, job: Callable[[], None]) -> None:
        """Run `job`, a small op, inline: now if there is room and nobody waits, else in a
        later turn's refill, in the order the ops came."""
        if self.take(nbytes):
            job()
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((self._cost(nbytes), job, done))
        self._refill_next_turn()
        await done

    def _cost(self, nbytes: int) -> int:
        return max(nbytes, self._op_cost)

    def _has_room(self, cost: int) -> bool:
        return not self._spent or self._spent + cost <= self._turn_bytes  # (a fresh one takes any)

    def _refill_next_turn(self) -> None:
        if not self._refilling:
            self._refilling = True
            asyncio.get_running_loop().call_soon(self._refill)

    def _refill(self) -> None:
        self._spent = 0
        self._refilling = False
        while self._waiting:
            cost, job, done = self._waiting[0]
            if done.done():  # (its task was cancelled)
                self._waiting.popleft()
                continue
            if not self._has_room(cost):
                break
            self._waiting.popleft()
            self._spent += cost
            try:
                job()
            except Exception as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)
        if self._waiting or self._spent > self._turn_bytes // 2:
            self._refill_next_turn()


class HostCommunicator:
    launches_in_order = False  # ops run on threads: the world queues them
    reports_async_errors = False  # see async_error

    def __init__(self, pool: ThreadPoolExecutor, parts: int, inline: InlineBudget,
                 net: WorldNet | None = None) -> None:
        self._pool = pool
        self._parts = parts
        self._inline = inline
        self._aborted = False
        # Ops that touch other daemons go over the network; the rest stay local.
        self._net = NetRunner(net, pool, _arr) if net is not None and len(net.members()) else None

    def try_inline(self, op: EngineOp) -> bool:
        if self._net is not None and _crosses(op):
            return False
        self._check()
        nbytes = op_nbytes(op)
        if not (self._inline.small(nbytes) and self._inline.take(nbytes)):
            return False
        self._run_inline(op)
        return True

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        self._check()
        if self._net is not None and _crosses(op):
            await self._net.run(op)
            return
        nbytes = op_nbytes(op)
        if self._inline.small(nbytes):  # (a thread's hop would cost more than the turn's wait)

            def job() -> None:
                self._check()  # (aborted while it waited)
                self._run_inline(op)

            await self._inline.run(nbytes, job)
            return
        await _in_turns(self._pool, _plan(op, self._parts, _JOB_BYTES), 2 * self._parts)

    @staticmethod
    def _run_inline(op: EngineOp) -> None:
        for job in _plan(op, 1):
            job()

    def _check(self) -> None:
        if self._aborted:
            raise CallError(ErrorCode.WORLD_FAILED, "communicator was aborted")

    def abort(self) -> None:
        self._aborted = True

    def busy(self) -> bool:
        return False  # a host op is answered when it is done

    def async_error(self) -> str | None:
        return None  # every host op reports its failure through its own run()

    def use_add_kernel(self, ranks: frozenset[int]) -> None:
        pass  # the host engine sums on the CPU either way

    def register(self, rank: int, key: int, region: Region) -> None:
        pass  # host memory is mapped once at import: nothing more to prepare

    def deregister(self, rank: int, key: int) -> None:
        pass


class HostEngine:
    name = "host"
    memory_kinds = frozenset({MemKind.HOST})

    def __init__(self, threads: int | None = None, inline_bytes: int = 64 * 1024) -> None:
        self._threads = threads or max(1, min(8, os.cpu_count() or 1))
        quiet_float_errors()  # the event loop thread runs small ops inline
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="commd-host",
                                        initializer=quiet_float_errors)
        # (16 ops of the largest size run inline: about a millisecond of the loop's time)
        self._inline = InlineBudget(inline_bytes, 16 * inline_bytes)
        self.unmapper = Unmapper()

    def import_memory(self, kind: MemKind, size: int, handle: bytes, fd: int | None,
                      device: int | None = None) -> HostMapping:
        if kind is not MemKind.HOST or fd is None:
            raise CallError(ErrorCode.MISUSE, f"the host engine cannot open {kind.value} memory")
        return HostMapping(fd, size, self.unmapper)

    def import_events(self, ready: bytes, done: bytes, device: int | None = None) -> EventPair:
        raise CallError(ErrorCode.MISUSE, "the host engine has no streams: stream events need a GPU engine")

    def allocate(self, nbytes: int, device: int | None = None) -> tuple[HostMapping, int]:
        try:
            fd = create_memfd(nbytes, "commd-symmetric")
        except OSError as exc:
            raise CallError(ErrorCode.LIMIT,
                            f"cannot allocate {nbytes} bytes: {exc}{open_files_hint(exc)}") from None
        try:
            mapping = HostMapping(fd, nbytes, self.unmapper)
        except BaseException:
            os.close(fd)
            raise
        return mapping, fd

    def communicator(self, world: str, epoch: int, world_size: int, local_ranks: Sequence[int],
                     net: WorldNet | None = None, *, devices: Mapping[int, int] | None = None,
                     unique_id: bytes = b"") -> HostCommunicator:
        return HostCommunicator(self._pool, self._threads, self._inline, net)

    def unique_id(self) -> bytes:
        return b""  # the host engine's data path is the daemons' own links

    def broken(self) -> str | None:
        return None

    def device_of(self, uuid: bytes) -> int | None:
        return None  # host memory only: a worker's GPU is no concern of this engine

    def check_device(self, device: int) -> None:
        pass  # (as above)

    def describe(self) -> str:
        return f"host ({self._threads} threads)"

    def on_loop_stall(self, announce: Callable[[float], None]) -> None:
        pass  # nothing of the host engine's holds the loop: long work runs on its threads

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.unmapper.close()
