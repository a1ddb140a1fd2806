"""The flight recorder: the last calls of every rank, and what became of them.

Each call of each rank gets a record when it reaches the daemon: its sequence
number on that rank, what was called, its state (pending: waiting for the other
ranks; running: matched and in the engine; done; failed) and when. The recorder
keeps the last `depth` records per rank. On a failure the world logs them, and
`commd status --json` shows them: the rank whose newest record is behind the
others', or pending where theirs are done, is the one that hung or strayed.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import Any

import proto

from . import ops
from .errors import named_ranks
from .stats import CallStats


class CallRecord:
    __slots__ = ("_open", "_shown", "ended", "op", "rank", "seq", "started", "state", "stats",
                 "waits_forever")

    def __init__(self, rank: int, seq: int, op: proto.Op, waits_forever: bool,
                 stats: CallStats | None = None, open_calls: dict[CallRecord, None] | None = None) -> None:
        self.rank = rank
        self.seq = seq
        self.op = op  # described only when read: formatting on every call costs latency
        self.state = "pending"
        self.started = time.monotonic()
        self.ended: float | None = None
        self.waits_forever = waits_forever  # recv_command_u32: no completion deadline
        self.stats = stats  # the daemon's counters, told once when the call ends
        self._open = open_calls  # the recorder's, which it leaves when it ends
        self._shown: dict[str, Any] | None = None  # as_dict's, once it ended (it stays so)
        if open_calls is not None:
            open_calls[self] = None

    @property
    def call(self) -> str:
        return ops.describe(self.op)

    def waiting_for_itself(self) -> str:
        """For a send or receive to its own rank still unmatched, the call of that rank it
        waits for (another thread's, or its group's): 'pending' alone reads as if a peer
        were late, when no other rank can end the wait."""
        op = self.op
        if self.state != "pending" or not isinstance(op, proto.Send | proto.Recv) or op.peer != self.rank:
            return ""
        own = proto.Recv(op.buf, op.nbytes, op.peer) if isinstance(op, proto.Send) else \
            proto.Send(op.buf, op.nbytes, op.peer)
        return f", waiting for rank {self.rank}'s own {ops.describe(own)}"

    def close(self, state: str) -> None:
        if self.ended is None:
            self.state = state
            self.ended = time.monotonic()
            if self._open is not None:
                self._open.pop(self, None)  # (gone already if its world failed meanwhile)
            if self.stats is not None:
                self.stats.record(self, state)

    def as_dict(self) -> dict[str, Any]:
        """For the status (read-only). An ended call's is kept: every status lists up to 8
        calls of each rank, and the full one of hundreds of worlds spent most of its time
        describing the same ended calls again (20 ms for 100 worlds of 8 ranks)."""
        if self._shown is not None:
            return self._shown
        now = time.monotonic()
        took = (self.ended if self.ended is not None else now) - self.started
        shown = {"rank": self.rank, "seq": self.seq, "call": self.call, "state": self.state,
                 "at": round(time.time() - (now - self.started), 6), "seconds": round(took, 6)}
        if self.ended is not None:
            self._shown = shown
        return shown


class FlightRecorder:
    def __init__(self, depth: int = 32, stats: CallStats | None = None) -> None:
        self._depth = depth
        self._stats = stats
        self._by_rank: dict[int, collections.deque[CallRecord]] = {}
        self._seq: dict[int, int] = {}
        # Every open call with a deadline, oldest first (records start in time order): the
        # rings keep only each rank's newest, and a rank may have more calls open than that
        # (async sends to a peer that stalled), whose oldest must still time out on time.
        self._open: dict[CallRecord, None] = {}

    def start(self, rank: int, op: proto.Op) -> CallRecord:
        seq = self._seq.get(rank, 0)
        self._seq[rank] = seq + 1
        forever = ops.waits_forever(op)
        record = CallRecord(rank, seq, op, forever, self._stats, None if forever else self._open)
        ring = self._by_rank.get(rank)
        if ring is None:
            ring = self._by_rank[rank] = collections.deque(maxlen=self._depth)
        ring.append(record)
        return record

    def keep_only(self, ranks: Iterable[int]) -> None:
        """Forget the calls of the ranks not in `ranks`: a rebuild placed them on another
        daemon, whose recorder holds their calls from now (here, their old calls would read
        as their newest in status, the logs and a timeout's message). Their numbering goes on."""
        wanted = set(ranks)
        for rank in [r for r in self._by_rank if r not in wanted]:
            del self._by_rank[rank]

    def end_deadlines(self) -> None:
        """The world failed: the calls still open are its engine's to end, or the abort's
        after the grace. Their deadline was the failed epoch's: a rebuilt world's watch must
        not fail the new epoch for them."""
        self._open.clear()

    def oldest_open(self) -> CallRecord | None:
        """The longest-waiting call that has a deadline (pending or running)."""
        return next(iter(self._open), None)

    def ranks(self) -> set[int]:
        """The ranks with a call on record."""
        return set(self._by_rank)

    def dump(self, last: int | None = None) -> dict[str, list[dict[str, Any]]]:
        return {str(rank): [r.as_dict() for r in list(ring)[-(last or self._depth):]]
                for rank, ring in sorted(self._by_rank.items())}

    def newest(self) -> dict[str, list[int]]:
        """Each rank's newest call as `lines` says it, with the ranks whose newest it is (in
        order): thousands of ranks at the same call read as one entry, not thousands."""
        ranks: dict[str, list[int]] = {}
        for rank, ring in sorted(self._by_rank.items()):
            r = ring[-1]
            ranks.setdefault(f"#{r.seq} {r.call} {r.state}{r.waiting_for_itself()}", []).append(rank)
        return ranks

    def lines(self, last: int = 4) -> list[str]:
        """A compact dump for the log: each rank's newest calls, a line for the ranks with the
        same (a failure of a world of 4000 ranks logged 4000 lines, most of them alike)."""
        ranks: dict[str, list[int]] = {}
        for rank, ring in sorted(self._by_rank.items()):
            calls = ", ".join(f"#{r.seq} {r.call} {r.state}{r.waiting_for_itself()}"
                              for r in list(ring)[-last:])
            ranks.setdefault(calls, []).append(rank)
        return [f"{named_ranks(of, whole=True)}: {calls}" for calls, of in ranks.items()]
