"""The host engine's data path between daemons: a star through the world's root.

Every collective k runs in two phases over the member ↔ root links:

- up: each member daemon sends the root one message stream for call k (step
  "up"): its local partial sum, its ranks' contributions, or just its arrival.
  Chunk 0 always goes, even for zero bytes, and carries the member's call in
  canonical form; the root compares it with its own, so a mismatch across
  daemons fails the world instead of hanging it.
- down: the root combines and sends each member what its ranks need (step "down").

Large buffers move in chunks of `CHUNK_BYTES`, so the root reduces chunk i
while chunk i+1 is still on the wire. Reductions: each daemon sums its own
ranks in rank order (bf16/f16 widened to float32); a member sends its partial
rounded to the element type (half the bytes of float32); the root adds the
members' partials to its own in order of their lowest rank, in float32, and
rounds once. Integer results are identical to a single daemon's; float sums can
differ from a single daemon's in the last bits, since the grouping (and, for
bf16/f16, one rounding per member daemon) follows the placement -- still no
more roundings on any path than NCCL's ring takes.

Point-to-point between daemons: the sender's daemon sends the bytes (step
"p2p") to the receiver's daemon, through the root when neither is the root;
the receiver checks the size, writes, and acknowledges ("p2p-ack"); the send
completes on the acknowledgement.

Flow control: a stream may run `WINDOW_CHUNKS` chunks ahead of its reader. The
reader, having taken chunk i of a stream that has more than i + WINDOW_CHUNKS
chunks, grants chunk i + WINDOW_CHUNKS (step "up-credit" or "p2p-credit", back
the way the data came); the sender waits for that grant before sending it. A
member's partial sums are granted by the root's results instead: it sends
chunk i once it took result i - WINDOW_CHUNKS, which the root sends only after
every daemon's chunk i - WINDOW_CHUNKS came, so neither the partials at the
root nor the results at the member pile up. So what a daemon holds for a
reader that has not called yet (a member's partials, a send before its
receive) is a window per stream, not the whole buffer, and the sender's call
waits as NCCL's does. Streams of at most WINDOW_CHUNKS chunks never wait: small
calls cost no extra message. The root's other "down" streams (all_gather,
broadcast) take no window: the root sends them once the member is in the call,
each chunk once the sockets took the one before, and the member takes each as
it comes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from proto import DType, ErrorCode, ReduceOp
from proto import peer as p

from ..errors import CallError
from .base import (
    AllGatherOp,
    AllReduceOp,
    BarrierOp,
    BroadcastOp,
    CallTag,
    EngineOp,
    RecvOp,
    ReduceScatterOp,
    Region,
    SendOp,
)
from .crosscheck import collective_mismatch, p2p_mismatch, pair_of
from .hostreduce import accumulate, accumulator, fold, narrow

if TYPE_CHECKING:
    from ..cluster import WorldNet

CHUNK_BYTES = 4 << 20
WINDOW_CHUNKS = 4
R = TypeVar("R")
ArrayOf = Callable[[Region], np.ndarray]


def _raw(array: np.ndarray) -> memoryview:
    """The array's bytes, not copied (it is contiguous: a slice of one buffer)."""
    return array.view(np.uint8).data  # through uint8: ml_dtypes' bf16 exports no buffer format


async def off_loop(pool: Executor, fn: Callable[[], R]) -> R:
    """`fn` on the engine's threads. Once the engine closed (the daemon stops, ops of other
    daemons' making still coming), the op fails with SHUTDOWN like the daemon's other calls,
    not with the pool's RuntimeError, an engine failure in the logs."""
    try:
        future = asyncio.get_running_loop().run_in_executor(pool, fn)
    except RuntimeError as exc:  # "cannot schedule new futures after shutdown"
        raise CallError(ErrorCode.SHUTDOWN, "the daemon is shutting down") from exc
    return await future


def sized(payload: bytes | bytearray, nbytes: int, call: str, chunk: int, daemon: str) -> bytes | bytearray:
    """`payload`, chunk `chunk` of `call` from `daemon`, if it holds the `nbytes` the call
    expects. Written as it came, a shorter one would be no error: numpy spreads a 1-byte
    chunk over the whole range, and a longer one's excess would be cut off unseen."""
    if len(payload) != nbytes:
        raise CallError(ErrorCode.MISMATCH, f"{call}: daemon {daemon} sent {len(payload)} bytes "
                                            f"for the {nbytes}-byte chunk {chunk}")
    return payload


def _place(full: np.ndarray, piece: np.ndarray, lo: int, ranks: Sequence[int], size: int) -> None:
    """Bytes [lo, lo + len(piece)) of a daemon's all_gather stream (its `ranks`' parts of
    `size` bytes, one after the other) to those ranks' places in `full`."""
    hi = lo + len(piece)
    for j, rank in enumerate(ranks):
        a, b = max(lo, j * size), min(hi, (j + 1) * size)
        if a < b:
            full[rank * size + a - j * size:rank * size + b - j * size] = piece[a - lo:b - lo]


def chunks(total: int, size: int) -> list[tuple[int, int]]:
    """[0, total) in pieces of `size`; one empty piece for an empty buffer."""
    return [(lo, min(lo + size, total)) for lo in range(0, total, size)] or [(0, 0)]


class NetRunner:
    """Runs ops that span daemons for one world's epoch."""

    def __init__(self, net: WorldNet, pool: Executor, array: ArrayOf) -> None:
        self.net = net
        # This epoch's: after a rebuild the world has a new inbox and epoch, and an op of
        # the old epoch that still runs must not read the new one's data.
        self.inbox = net.inbox
        self.epoch = net.epoch
        self._pool = pool
        self._array = array

    async def run(self, op: EngineOp) -> None:
        handler = {
            AllReduceOp: self._all_reduce, ReduceScatterOp: self._reduce_scatter,
            AllGatherOp: self._all_gather, BroadcastOp: self._broadcast, BarrierOp: self._barrier,
            SendOp: self._send, RecvOp: self._recv,
        }.get(type(op))
        if handler is None:
            raise CallError(ErrorCode.INTERNAL, f"no cross-daemon path for {type(op).__name__}")
        await handler(op)  # type: ignore[operator]

    # ---- plumbing -------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[[], R]) -> R:
        return await off_loop(self._pool, fn)

    def _data(self, step: str, tag: CallTag, chunk: int, source: int,
              about: tuple[int, ...] = (), fingerprint: str | None = None) -> p.Data:
        return p.Data(self.net.world, self.epoch, step, tag.index, chunk, source,
                      tag.fingerprint if fingerprint is None else fingerprint, about)

    async def _up(self, tag: CallTag, chunk: int, member: str, nbytes: int,
                  count: int = 0) -> bytes | bytearray:
        """The root takes chunk `chunk` of a member's up stream, checking the call matches
        and the chunk holds `nbytes`, and grants the member the chunk the window now allows,
        if the stream has `count` chunks (0: the root's results grant them, see _reduced)."""
        source = min(self.net.ranks_of(member))
        msg, payload = await self.inbox.get(("up", tag.index, chunk, source))
        if msg.fingerprint != tag.fingerprint:
            raise collective_mismatch(tag.index, min(self.net.ranks_of(self.net.me)), tag.fingerprint,
                                      source, msg.fingerprint)
        sized(payload, nbytes, f"call {tag.index}", chunk, member)
        if chunk + WINDOW_CHUNKS < count:
            self.net.send(member, self._data("up-credit", tag, chunk, source))
        return payload

    async def _window(self, step: str, tag: CallTag, chunk: int, source: int) -> None:
        """A sender waits, before chunk `chunk` of its stream, for its reader's grant."""
        if chunk >= WINDOW_CHUNKS:
            await self.inbox.get((f"{step}-credit", tag.index, chunk - WINDOW_CHUNKS, source))

    async def _down(self, tag: CallTag, chunk: int, nbytes: int) -> bytes | bytearray:
        _, payload = await self.inbox.get(("down", tag.index, chunk, 0))
        return sized(payload, nbytes, f"call {tag.index}", chunk, self.net.placement[0])

    async def _send_up(self, tag: CallTag, chunk: int, payload: bytes | memoryview,
                       about: Sequence[int], granted: bool = False) -> None:
        """A member sends the root chunk `chunk` of its up stream, once the window allows
        (`granted`: the caller made sure of it)."""
        if not granted:
            await self._window("up", tag, chunk, min(about))
        self.net.send("root", self._data("up", tag, chunk, min(about), tuple(about)), payload)

    def _send_down(self, tag: CallTag, chunk: int, payload: bytes | memoryview,
                   members: Sequence[str] | None = None) -> None:
        for member in self.net.members() if members is None else members:
            self.net.send(member, self._data("down", tag, chunk, 0), payload)

    # ---- reductions ------------------------------------------------------------------

    async def _reduced(self, srcs: list[np.ndarray], dtype: DType, op: ReduceOp, tag: CallTag,
                       deliver: Callable[[int, int, np.ndarray], None]) -> None:
        """Reduce `srcs` (this daemon's ranks, rank order) with every other daemon's, chunk by
        chunk; `deliver(lo, hi, result)` gets each chunk of the final result (root and members)."""
        item = dtype.itemsize
        total = len(srcs[0])
        pieces = chunks(total, CHUNK_BYTES // item * item)
        acc = accumulator(dtype, (pieces[0][1] - pieces[0][0]) // item)

        def local_sum(lo: int, hi: int, narrowed: bool) -> np.ndarray:
            summed = accumulate([s[lo:hi] for s in srcs], dtype, op, acc[:(hi - lo) // item])
            return narrow(summed, dtype) if narrowed else summed

        if not self.net.is_root:
            local_ranks = self.net.ranks_of(self.net.me)

            async def take(i: int) -> None:
                lo, hi = pieces[i]
                result = np.frombuffer(await self._down(tag, i, hi - lo), np.uint8)
                deliver(lo, hi, result)  # (only chunk i's range, summed already: in place is safe)

            for i, (lo, hi) in enumerate(pieces):
                if i >= WINDOW_CHUNKS:  # the result of chunk i - W is the grant of chunk i
                    await take(i - WINDOW_CHUNKS)
                # a partial crosses the wire in the element type: half the bytes of float32
                wire = await self._off_loop(functools.partial(local_sum, lo, hi, True))
                await self._send_up(tag, i, _raw(wire), local_ranks, granted=True)
                await self.net.drain()
            for i in range(max(0, len(pieces) - WINDOW_CHUNKS), len(pieces)):
                await take(i)
            return
        members = self.net.members()  # in order of their lowest rank; ours (rank 0) comes first
        for i, (lo, hi) in enumerate(pieces):
            mine = await self._off_loop(functools.partial(local_sum, lo, hi, False))
            for member in members:
                theirs = np.frombuffer(await self._up(tag, i, member, hi - lo), np.uint8)  # (results grant)
                await self._off_loop(functools.partial(fold, mine, theirs, dtype, op))
            result = (await self._off_loop(functools.partial(narrow, mine, dtype))).view(np.uint8)
            self._send_down(tag, i, _raw(result))
            deliver(lo, hi, result)
            await self.net.drain()

    async def _all_reduce(self, op: AllReduceOp) -> None:
        ranks = sorted(op.bufs)
        arrays = [self._array(op.bufs[r]) for r in ranks]

        def deliver(lo: int, hi: int, result: np.ndarray) -> None:
            for a in arrays:
                a[lo:hi] = result

        await self._reduced(arrays, op.dtype, op.op, op.tag, deliver)

    async def _reduce_scatter(self, op: ReduceScatterOp) -> None:
        ranks = sorted(op.sends)
        sends = [self._array(op.sends[r]) for r in ranks]
        outs = {r: self._array(op.recvs[r]) for r in ranks}
        share = len(next(iter(outs.values())))

        def deliver(lo: int, hi: int, result: np.ndarray) -> None:
            for rank, out in outs.items():  # the part of [lo, hi) that is this rank's share
                a, b = max(lo, rank * share), min(hi, (rank + 1) * share)
                if a < b:
                    out[a - rank * share:b - rank * share] = result[a - lo:b - lo]

        await self._reduced(sends, op.dtype, op.op, op.tag, deliver)

    # ---- data movement ------------------------------------------------------------------

    async def _all_gather(self, op: AllGatherOp) -> None:
        ranks = sorted(op.sends)
        size = op.sends[ranks[0]].nbytes
        outs = [self._array(op.recvs[r]) for r in ranks]
        # Whole buffers are copied on the engine's threads: on the loop, a call of hundreds of
        # MiB stood still every world's heartbeats for a fraction of a second
        if not self.net.is_root:
            sends = [self._array(op.sends[r]) for r in ranks]
            mine = sends[0] if len(sends) == 1 else await self._off_loop(lambda: np.concatenate(sends))
            for i, (lo, hi) in enumerate(chunks(len(mine), CHUNK_BYTES)):
                await self._send_up(op.tag, i, _raw(mine[lo:hi]), ranks)
            await self.net.drain()
            for i, (lo, hi) in enumerate(chunks(len(outs[0]), CHUNK_BYTES)):
                piece = np.frombuffer(await self._down(op.tag, i, hi - lo), np.uint8)
                for out in outs:
                    out[lo:hi] = piece
            return
        full = outs[0]

        def own() -> None:
            for r in ranks:
                full[r * size:(r + 1) * size] = self._array(op.sends[r])

        await self._off_loop(own)
        for member in self.net.members():
            theirs = self.net.ranks_of(member)
            pieces = chunks(len(theirs) * size, CHUNK_BYTES)
            for i, (lo, hi) in enumerate(pieces):
                piece = np.frombuffer(await self._up(op.tag, i, member, hi - lo, len(pieces)), np.uint8)
                _place(full, piece, lo, theirs, size)
        for i, (lo, hi) in enumerate(chunks(len(full), CHUNK_BYTES)):
            self._send_down(op.tag, i, _raw(full[lo:hi]))
            await self.net.drain()  # (see _broadcast)

        def copies() -> None:
            for out in outs[1:]:
                out[...] = full

        await self._off_loop(copies)

    async def _broadcast(self, op: BroadcastOp) -> None:
        ranks = sorted(op.bufs)
        arrays = [self._array(op.bufs[r]) for r in ranks]
        pieces = chunks(len(arrays[0]), CHUNK_BYTES)
        source = self.net.placement[op.root]
        if not self.net.is_root:
            if source == self.net.me:
                data = self._array(op.bufs[op.root])
                for i, (lo, hi) in enumerate(pieces):
                    await self._send_up(op.tag, i, _raw(data[lo:hi]), ranks)
                for a in arrays:
                    a[...] = data
                await self.net.drain()
                await self._down(op.tag, 0, 0)  # like every collective, done when all have come
                return
            await self._send_up(op.tag, 0, b"", ranks)  # arrival, and the call for comparison
            await self.net.drain()
            for i, (lo, hi) in enumerate(pieces):
                received = np.frombuffer(await self._down(op.tag, i, hi - lo), np.uint8)
                for a in arrays:
                    a[lo:hi] = received
            return
        members = self.net.members()
        for member in members:
            if member != source:
                await self._up(op.tag, 0, member, 0)
        local_source = source == self.net.me
        for i, (lo, hi) in enumerate(pieces):
            piece = self._array(op.bufs[op.root])[lo:hi] if local_source else np.frombuffer(
                await self._up(op.tag, i, source, hi - lo, len(pieces)), np.uint8)
            self._send_down(op.tag, i, _raw(piece), [m for m in members if m != source])
            for a in arrays:
                a[lo:hi] = piece
            # Each chunk taken by the sockets before the next is sealed: sealed in one go, the
            # whole result sat in memory once per member until a slow network took it, and
            # the loop (every world's heartbeats) stood still while it sealed: a big enough
            # call had the members, and every other world on these links, take us for lost.
            await self.net.drain()
        if source != self.net.me:
            self._send_down(op.tag, 0, b"", [source])
        await self.net.drain()

    async def _barrier(self, op: BarrierOp) -> None:
        if not self.net.is_root:
            await self._send_up(op.tag, 0, b"", self.net.ranks_of(self.net.me))
            await self._down(op.tag, 0, 0)
            return
        for member in self.net.members():
            await self._up(op.tag, 0, member, 0)
        self._send_down(op.tag, 0, b"")

    # ---- point to point -----------------------------------------------------------------

    def _route(self, rank: int, msg: p.Data, payload: bytes | memoryview) -> None:
        daemon = self.net.placement[rank]
        self.net.send(daemon, msg, payload)

    async def _send(self, op: SendOp) -> None:
        pair = pair_of(op.src_rank, op.dst_rank)
        data = self._array(op.src) if op.src.nbytes else np.zeros(0, np.uint8)
        for i, (lo, hi) in enumerate(chunks(len(data), CHUNK_BYTES)):
            await self._window("p2p", op.tag, i, pair)
            msg = self._data("p2p", op.tag, i, pair, (op.dst_rank,), fingerprint=str(len(data)))
            self._route(op.dst_rank, msg, _raw(data[lo:hi]))
            await self.net.drain()
        await self.inbox.get(("p2p-ack", op.tag.index, 0, pair))

    async def _recv(self, op: RecvOp) -> None:
        pair = pair_of(op.src_rank, op.dst_rank)
        out = self._array(op.dst) if op.dst.nbytes else np.zeros(0, np.uint8)
        pieces = chunks(len(out), CHUNK_BYTES)
        for i, (lo, hi) in enumerate(pieces):
            msg, payload = await self.inbox.get(("p2p", op.tag.index, i, pair))
            if msg.fingerprint != str(len(out)):
                raise p2p_mismatch(op.src_rank, op.dst_rank, op.tag.index, msg.fingerprint, len(out),
                                   self.net.placement[op.src_rank])
            sized(payload, hi - lo, f"point-to-point {op.src_rank}->{op.dst_rank} call {op.tag.index}", i,
                  self.net.placement[op.src_rank])
            out[lo:hi] = np.frombuffer(payload, np.uint8)
            if i + WINDOW_CHUNKS < len(pieces):
                self._route(op.src_rank, self._data("p2p-credit", op.tag, i, pair, (op.src_rank,)), b"")
        ack = self._data("p2p-ack", op.tag, 0, pair, (op.src_rank,))
        self._route(op.src_rank, ack, b"")
        await self.net.drain()
