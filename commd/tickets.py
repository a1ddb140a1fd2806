"""A rank's requests and the calls in them, as the world matches and runs them.

A request (one call, or a worker's group of calls) is a `Ticket`, answered exactly
once; each of its calls enters matching as an `Arrival`. A match of arrivals
becomes one engine op (`engine_op_of`), ordered with the workers' streams as their
calls asked (`order_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import proto
from proto import ErrorCode

from . import ops
from .engine.base import (
    EMPTY,
    NO_TAG,
    CallTag,
    EngineOp,
    EventPair,
    Order,
    RecvOp,
    Region,
    SendOp,
    TransferOp,
)
from .errors import clip
from .matching import CollectiveMatch, Match, RemoteP2P
from .recorder import CallRecord


class Peer(Protocol):
    """What a world needs of a rank's connection."""

    def send(self, msg: proto.Reply, fds: Sequence[int] = ()) -> None: ...

    def close_if_hung_up(self) -> bool:
        """Close now if the client hung up, though its last packets are still unread;
        whether the connection is closed (now or before)."""


class Ticket:
    """One request (a call or a group of calls) of one rank; replied to exactly once."""

    __slots__ = ("_failure", "done", "epoch", "executing", "peer", "rank", "records", "remaining",
                 "request_id")

    def __init__(self, peer: Peer, rank: int, request_id: int, count: int, epoch: int) -> None:
        self.peer = peer
        self.rank = rank
        self.request_id = request_id
        self.epoch = epoch  # of the world its calls were entered in
        self.remaining = count
        self.executing = 0  # of the remaining ops, those matched and handed to the engine
        self.done = False
        self.records: list[CallRecord] = []
        self._failure: tuple[ErrorCode, str] | None = None  # told once no op of it runs

    def op_ended(self, failure: tuple[ErrorCode, str] | None = None) -> None:
        """One of its ops left the engine's hands: done, or failed with `failure`."""
        self.executing -= 1
        self.remaining -= 1
        self._failure = self._failure or failure  # (the first one told)
        if self._failure is not None:
            self.fail_when_idle(*self._failure)
        elif self.remaining == 0 and not self.done:
            self.done = True
            self.peer.send(proto.Ok(self.request_id))

    def fail_when_idle(self, code: ErrorCode, message: str) -> None:
        """Fail now, or once the last of its ops that run on the engine ends: until then they
        may write the worker's memory, and a worker told its call failed takes its buffers
        back at once (a group's op running when the world failed under its unmatched one)."""
        if self.executing:
            self._failure = self._failure or (code, message)
        else:
            self.fail(code, message)

    def fail(self, code: ErrorCode, message: str) -> None:
        if not self.done:
            self.done = True
            for record in self.records:
                record.close("failed")
            self.peer.send(proto.Error(self.request_id, code, clip(message)))


@dataclass(slots=True)  # per call: plain init is cheaper than frozen
class Arrival:
    ticket: Ticket
    regions: tuple[Region | None, ...]
    record: CallRecord
    events: EventPair | None = None  # the worker's stream events (a stream_submit)
    early: bool = False  # answer once ordered on the device


def arrivals_of(match: Match[Arrival]) -> list[Arrival]:
    """The calls a match joined, one per rank it holds here."""
    if isinstance(match, CollectiveMatch):
        return [c.token for c in match.calls.values()]
    if isinstance(match, RemoteP2P):
        return [match.call.token]
    return [match.send.token, match.recv.token]


def engine_op_of(match: Match[Arrival], spans_daemons: bool) -> EngineOp | None:
    """What the engine runs for a match (None: nothing to move)."""
    # Zero bytes move nothing on one daemon (matching every rank's call was the
    # meeting). Across daemons the call still meets its peers there: ranks that leave
    # right after it must not fail a world whose other ranks have not reached it yet.
    if isinstance(match, CollectiveMatch):
        op = match.op
        regions: dict[int, tuple[Region | None, ...]]
        if ops.nbytes(op) == 0 and not isinstance(op, proto.Barrier):
            if not spans_daemons:
                return None
            regions = {rank: (EMPTY, EMPTY) for rank in match.calls}
        else:
            regions = {rank: c.token.regions for rank, c in match.calls.items()}
        # the canonical form is what daemons compare; one daemon has no one to compare with
        tag = CallTag(match.index, ops.describe(op, canonical=True)) if spans_daemons else NO_TAG
        return ops.to_engine(op, regions, tag)
    if isinstance(match, RemoteP2P):
        call, region = match.call, match.call.token.regions[0] or EMPTY
        tag = CallTag(match.index, ops.describe(call.op, canonical=True))
        peer: int = call.op.peer  # type: ignore[union-attr]
        if isinstance(call.op, proto.Send):
            return SendOp(call.rank, peer, region, tag)
        return RecvOp(peer, call.rank, region, tag)
    src, dst = match.send.token.regions[0], match.recv.token.regions[0]
    if src is None or dst is None:
        return None
    return TransferOp(match.send.rank, src, match.recv.rank, dst)


def order_of(arrivals: list[Arrival]) -> Order | None:
    """The op's order with its workers' streams: each rank's events; early only when
    every call asked (one waiting for its result holds the reply of all)."""
    events = {a.ticket.rank: a.events for a in arrivals if a.events is not None}
    if not events:
        return None
    return Order(events, early=all(a.early for a in arrivals))
