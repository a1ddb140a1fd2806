"""The host engine: workers' memfd-backed memory, mapped here, moved by the CPU.

A complete engine for machines without GPUs and for tests (DESIGN §6). Memory
arrives as a memfd over SCM_RIGHTS; it must be sealed against shrinking, since a
worker that truncated a mapped file would make the daemon fault (SIGBUS) on the
next access. Ops bigger than `inline_bytes` run on a thread pool, cut into
ranges, so the event loop stays free for heartbeats and small calls. Smaller ones
run on the loop within a budget per turn of it (`InlineBudget`); past it they
wait, in order, for a later turn (a group of hundreds of small ops, all matched
in one turn, would otherwise hold the loop for all of them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import gc
import mmap
import os
import stat
import weakref
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
from .hostnet import NetRunner, off_loop
from .hostreduce import CHUNK_ELEMS, quiet_float_errors, reduce_range, split

if TYPE_CHECKING:
    from ..cluster import WorldNet

Job = Callable[[], None]
_SEALS_NEEDED = fcntl.F_SEAL_SHRINK


class HostRegion:
    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class Lingering:
    """Unmaps closed mappings on a thread of its own: the last unmap of a departed
    worker's memory frees every page of it, ~1.5 s for 10 GiB, time the loop would not
    serve anyone (its peers would take that for a lost daemon). Mappings closed while
    something still held a view of them (an op in flight, or a failed op's traceback in
    a reference cycle) are retried until they unmap, so a departed client's memory is
    let go within about a second, not at the next collection, which the daemon's tuned
    collector may not run for a long time. `on_released` runs on the loop, once unmapped."""

    RETRY_S = 0.5
    # What the loop unmaps itself in one turn, of mappings no view holds (~0.1 ms of page
    # frees, less than the thread's round trip); more (a departing worker's thousands of
    # buffers, or one large one) goes on the thread
    AT_ONCE_BYTES = 1 << 20

    def __init__(self) -> None:
        self._maps: list[tuple[mmap.mmap, Callable[[], None] | None]] = []  # and who waits for it
        self._timer: asyncio.TimerHandle | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="commd-unmap")
        self._in_flight = 0  # handed to the thread, not yet back
        self._at_once = 0  # bytes the loop unmapped itself this turn

    def release(self, mapped: mmap.mmap, on_released: Callable[[], None] | None = None) -> None:
        if self._unmapped_at_once(mapped, on_released):
            return
        try:
            loop = asyncio.get_running_loop()
            self._thread.submit(self._unmap, loop, mapped, on_released)
        except RuntimeError:  # no loop (closed by hand), or shut down: here and now
            if not unmap(mapped, on_released) and on_released is not None:
                on_released()  # (unmapped with the last view; nobody can wait for that)
            return
        self._in_flight += 1

    def _unmapped_at_once(self, mapped: mmap.mmap, on_released: Callable[[], None] | None) -> bool:
        """Unmapped here, on the loop, within this turn's AT_ONCE_BYTES (no view held it)."""
        size = len(mapped)
        if self._at_once + size > self.AT_ONCE_BYTES:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if not unmap(mapped, on_released):
            return False
        if self._at_once == 0:
            loop.call_soon(self._new_turn)
        self._at_once += size
        return True

    def _new_turn(self) -> None:
        self._at_once = 0

    def _unmap(self, loop: asyncio.AbstractEventLoop, mapped: mmap.mmap,
               on_released: Callable[[], None] | None) -> None:
        """(on the thread)"""
        done = unmap(mapped, None)
        with contextlib.suppress(RuntimeError):  # the loop is gone, and whoever waited with it
            loop.call_soon_threadsafe(self._back, mapped, on_released, done)

    def _back(self, mapped: mmap.mmap, on_released: Callable[[], None] | None, done: bool) -> None:
        self._in_flight -= 1
        if not done:
            self._maps.append((mapped, on_released))
            self._schedule()
        elif on_released is not None:
            on_released()

    def __len__(self) -> int:
        return len(self._maps) + self._in_flight

    def _schedule(self) -> None:
        if self._timer is None and self._maps:
            self._timer = asyncio.get_running_loop().call_later(self.RETRY_S, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        gc.collect()  # views kept only by garbage cycles go now
        maps, self._maps = self._maps, []
        for mapped, on_released in maps:
            self.release(mapped, on_released)

    def close(self) -> None:
        """Wait for the unmaps under way."""
        self._thread.shutdown(wait=True)


def unmap(mapped: mmap.mmap, on_released: Callable[[], None] | None) -> bool:
    """Unmap now and tell `on_released`; False (nothing done) while a view is still held."""
    try:
        mapped.close()
    except BufferError:
        return False
    if on_released is not None:
        on_released()
    return True


_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class HostMapping:
    """A shared mapping of one memfd (`fd` stays the caller's). Closing drops it; a view
    still held keeps it (see Lingering)."""

    def __init__(self, fd: int, size: int, lingering: Lingering) -> None:
        try:
            # first, as it asks the file's filesystem nothing: a client's fd may be of a
            # FUSE file, whose fstat waits on its server (for good, if it never answers)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise CallError(ErrorCode.BAD_MEMORY, "host memory must be a sealable memfd") from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CallError(ErrorCode.BAD_MEMORY, "host memory must be a memfd")
            if info.st_size < size:
                raise CallError(ErrorCode.BAD_MEMORY,
                                f"memfd holds {info.st_size} bytes, {size} were claimed")
            if not seals & _SEALS_NEEDED:
                raise CallError(ErrorCode.BAD_MEMORY, "memfd must be sealed against shrinking")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                     mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            # out of fds (the mmap keeps a copy of the fd) or of memory: the daemon's limits
            code = ErrorCode.LIMIT if exc.errno in _OUT_OF_RESOURCES else ErrorCode.BAD_MEMORY
            raise CallError(code, f"cannot map host memory: {exc}") from None
        self._array: np.ndarray | None = np.frombuffer(self._mmap, np.uint8)
        self._size = size
        self._lingering = lingering

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> int | None:
        return None

    def region(self, offset: int, nbytes: int) -> HostRegion:
        if self._array is None:
            raise CallError(ErrorCode.UNKNOWN_BUFFER, "buffer was released")
        if offset + nbytes > self._size:
            raise CallError(
                ErrorCode.BAD_MEMORY,
                f"bytes [{offset}, {offset + nbytes}) are outside the {self._size}-byte allocation",
            )
        return HostRegion(self._array[offset:offset + nbytes])

    def close(self, on_released: Callable[[], None] | None = None,
              on_let_go: Callable[[], None] | None = None) -> None:
        mapped, self._mmap = self._mmap, None
        if mapped is None or self._array is None:
            return
        # every region is a view of the array and keeps it alive: gone with our reference,
        # no op holds the memory, and the caller hears so now, not when the unmap (on the
        # thread, for a large mapping) comes back, which is after the client's next packet
        views = weakref.ref(self._array)
        self._array = None
        if on_let_go is not None:
            if views() is None:
                on_let_go()
            else:  # (an op holds it: it lets go as the unmap succeeds)
                on_released = _one_then_other(on_let_go, on_released)
        self._lingering.release(mapped, on_released)


def _one_then_other(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    def both() -> None:
        first()
        if then is not None:
            then()
    return both


def create_memfd(nbytes: int, name: str) -> int:
    """A memfd of `nbytes`, sealed so neither side can shrink or grow it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def _plan(op: EngineOp, parts: int) -> list[Job]:
    """Cut an op into independent jobs that touch disjoint output bytes."""
    if isinstance(op, AllReduceOp):
        arrays = [_arr(op.bufs[rank]) for rank in sorted(op.bufs)]  # rank order fixes the float sum
        align = CHUNK_ELEMS * op.dtype.itemsize
        return [
            _bind_reduce([a[lo:hi] for a in arrays], [a[lo:hi] for a in arrays], op)
            for lo, hi in split(len(arrays[0]), parts, align)
        ]
    if isinstance(op, ReduceScatterOp):
        sends = [_arr(op.sends[r]) for r in sorted(op.sends)]
        align = CHUNK_ELEMS * op.dtype.itemsize
        jobs = []
        for rank, recv in op.recvs.items():
            out = _arr(recv)
            base = rank * len(out)
            for lo, hi in split(len(out), max(1, parts // len(op.recvs)), align):
                jobs.append(_bind_reduce([s[base + lo:base + hi] for s in sends], [out[lo:hi]], op))
        return jobs
    if isinstance(op, AllGatherOp):
        jobs = []
        for recv in op.recvs.values():
            out = _arr(recv)
            for src_rank, send in op.sends.items():
                size = send.nbytes
                jobs.append(_bind_copy(out[src_rank * size:(src_rank + 1) * size], _arr(send)))
        return jobs
    if isinstance(op, BroadcastOp):
        source = _arr(op.bufs[op.root])
        return [_bind_copy(_arr(r), source) for rank, r in op.bufs.items() if rank != op.root]
    if isinstance(op, TransferOp):
        return [_bind_copy(_arr(op.dst), _arr(op.src))]
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
        await asyncio.gather(*(off_loop(self._pool, job) for job in _plan(op, self._parts)))

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

    def use_add_kernel(self, enabled: bool) -> None:
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
        self.lingering = Lingering()

    def import_memory(self, kind: MemKind, size: int, handle: bytes, fd: int | None,
                      device: int | None = None) -> HostMapping:
        if kind is not MemKind.HOST or fd is None:
            raise CallError(ErrorCode.MISUSE, f"the host engine cannot open {kind.value} memory")
        return HostMapping(fd, size, self.lingering)

    def import_events(self, ready: bytes, done: bytes, device: int | None = None) -> EventPair:
        raise CallError(ErrorCode.MISUSE, "the host engine has no streams: stream events need a GPU engine")

    def allocate(self, nbytes: int, device: int | None = None) -> tuple[HostMapping, int]:
        try:
            fd = create_memfd(nbytes, "commd-symmetric")
        except OSError as exc:
            raise CallError(ErrorCode.LIMIT, f"cannot allocate {nbytes} bytes: {exc}") from None
        try:
            mapping = HostMapping(fd, nbytes, self.lingering)
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
        self.lingering.close()
