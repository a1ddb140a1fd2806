"""One world: its ranks, its state machine, call matching (oprunner.py runs the matched ops).

    FORMING --all ranks said hello / attempt_reconnect--> READY (epoch + 1)
    READY --rank lost, mismatch, engine error, reconnect--> FAILED
    FAILED --first attempt_reconnect or a new rank's hello--> FORMING

The world is the only place that decides its state. On failure every pending
call gets a typed error, every connected rank gets a pushed event, and the
communicator is aborted; other worlds never notice.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, KeysView, Sequence
from dataclasses import dataclass, field

import proto
from proto import ErrorCode

from .cluster import WorldNet
from .engine.base import Communicator, Engine, EventPair, Region
from .engine_extras import EngineExtras
from .errors import MAX_CAUSE, CallError, clip, framed, rank_list
from .matching import Call, Matcher, Mismatch
from .membership import LocalMembership, NetMembership
from .oprunner import OpRunner, given_up
from .recorder import FlightRecorder
from .stats import DaemonStats
from .tickets import Arrival, Peer, Ticket, arrivals_of, engine_op_of
from .watchdog import Watchdog

log = logging.getLogger("commd.world")
# How an idle world ends without anything failing: a rank leaves, the daemon stops.
_ENDINGS = frozenset({ErrorCode.WORLD_FAILED, ErrorCode.SHUTDOWN})


class WorldState(enum.Enum):
    FORMING = "forming"
    READY = "ready"
    FAILED = "failed"


@dataclass(slots=True)
class Waiter:
    """A rank waiting for the world to form: its hello, or its attempt_reconnect."""

    peer: Peer
    request_id: int
    is_hello: bool
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _End:
    """A ready epoch's end, as the log and the counters tell it."""

    epoch: int
    code: ErrorCode
    message: str
    extra: dict[str, object]
    recorder_lines: list[str]
    running: set[Ticket] = field(default_factory=set)  # calls whose end tells which it was


class World:
    def __init__(self, name: str, world_size: int, token: str | None, engine: Engine,
                 on_empty: Callable[[World], None], net: WorldNet | None = None,
                 max_pending_ops: int = 4096, call_timeout_s: float | None = None,
                 stats: DaemonStats | None = None) -> None:
        self.name = name
        self.world_size = world_size
        self.token = token
        self.state = WorldState.FORMING
        self.epoch = 0
        self.cause: str | None = None
        self.cause_code = ErrorCode.WORLD_FAILED
        self.members: dict[int, Peer] = {}
        self._engine = engine
        self._on_empty = on_empty
        self._waiting: dict[int, Waiter] = {}
        self.net = net  # None: every rank is on this daemon
        self.membership: LocalMembership | NetMembership = (
            LocalMembership(self) if net is None else NetMembership(self, net, token))
        self.local_ranks: tuple[int, ...] = ()
        self._matcher: Matcher[Arrival] = Matcher(world_size, ())
        self._comm: Communicator | None = None
        self.tickets: set[Ticket] = set()
        self.unsettled: list[_End] = []  # ends told with calls running (see fail)
        self._runner = OpRunner(self)
        self._max_pending_ops = max_pending_ops
        self.stats = stats if stats is not None else DaemonStats()  # the daemon's: outlive worlds
        self.recorder = FlightRecorder(stats=self.stats.calls)
        self.call_timeout_s = call_timeout_s  # a call open longer fails the world (None: never)
        self.watchdog = Watchdog(self)
        self.pending_ops: dict[int, int] = {}  # rank -> its calls not yet done
        self._devices: dict[int, int] = {}  # rank -> the GPU its hello named
        self._extras = EngineExtras(world_size, local=net is None)
        self.forgotten = False  # over on this daemon (`forget_if_empty`): its registry let it go

    # ---- forming ----------------------------------------------------------------

    def holds(self, rank: int) -> bool:
        return rank in self.members or rank in self._waiting

    def free_if_hung_up(self, rank: int) -> None:
        """The daemon reads a connection a packet a wakeup: one whose client closed with
        packets still unread holds its rank until the last is read. A new process for the
        rank (a worker's rejoin right after close(), a restart) must not be refused for it."""
        waiter = self._waiting.get(rank)
        holder = self.members.get(rank) or (waiter.peer if waiter is not None else None)
        if holder is not None:
            holder.close_if_hung_up()  # (its close lets go of the rank, as at its end)

    def join(self, peer: Peer, hello: proto.Hello) -> None:
        """A new connection asks for `hello.rank`; the caller checked the slot is free."""
        if self.state is WorldState.FAILED:
            self.start_forming()
        if self.state is WorldState.FORMING:
            # a rank back from a daemon restart: this (new) world continues its numbering
            self.epoch = max(self.epoch, hello.epoch)
        self._devices[hello.rank] = hello.device or 0
        self._wait(hello.rank, Waiter(peer, hello.id, True), hello.timeout_ms / 1000)

    def reconnect(self, rank: int, peer: Peer, request_id: int, timeout_s: float) -> None:
        # (its vote would fail the world its rank runs in, or, the world ended and forgotten
        # here, be cast for a world the registry no longer holds, whose WorldReady finds none)
        self._check_member(rank, peer)
        self.stats.reconnects += 1
        self.reconnect_requested(f"rank {rank} called attempt_reconnect")
        old = self._waiting.pop(rank, None)
        if old is not None:
            self._cancel(old, ErrorCode.MISUSE, "superseded by a newer attempt_reconnect")
        self._wait(rank, Waiter(peer, request_id, False), timeout_s)

    def reconnect_requested(self, why: str) -> None:
        """A rank (here or, for the root, on a member) votes to rebuild: stop what runs."""
        if self.state is WorldState.READY:
            self.fail(ErrorCode.WORLD_FAILED, why)
        if self.state is WorldState.FAILED:
            self.start_forming()

    def start_forming(self) -> None:
        self.state = WorldState.FORMING
        self.stats.transition(self.state.value)
        log.info("world %s epoch %d: forming", self.name, self.epoch, extra=self.log_extra())

    def local_waiting(self) -> KeysView[int]:
        """A view, not a copy: each vote asks whether its rank still waits (a copy each was
        O(ranks) a vote, O(ranks²) a world)."""
        return self._waiting.keys()

    def _wait(self, rank: int, waiter: Waiter, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        # A member's own deadline is a backstop: the root names the missing ranks first.
        backstop = 0.0 if self.net is None else proto.JOIN_BACKSTOP_S
        waiter.timer = loop.call_later(timeout_s + backstop, self._expire, rank, waiter, timeout_s)
        self._waiting[rank] = waiter
        self.membership.vote(rank, timeout_s)

    def _expire(self, rank: int, waiter: Waiter, timeout_s: float) -> None:
        if self._waiting.get(rank) is not waiter:
            return
        missing = self.membership.missing()
        which = (f"ranks {rank_list(missing)} did not arrive" if missing else
                 f"the root daemon ({self.net.bootstrap}) did not form it" if self.net is not None else
                 "it did not form")  # (every rank came once: one that left is missing again)
        self.refuse(rank, ErrorCode.TIMEOUT, f"world {self.name}: {which} within {timeout_s:g}s")

    def refuse(self, rank: int, code: ErrorCode, message: str) -> None:
        """Fail one rank's pending hello or attempt_reconnect."""
        waiter = self._waiting.pop(rank, None)
        if waiter is None:
            return
        self.membership.withdraw(rank, left=False)
        self._cancel(waiter, code, message)
        self.forget_if_empty()

    def _cancel(self, waiter: Waiter, code: ErrorCode, message: str) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiter.peer.send(proto.Error(waiter.request_id, code, clip(message)))

    def engine_id(self) -> bytes:
        """The root's: what every daemon builds this epoch's communicators from."""
        return self._engine.unique_id()

    def form(self, epoch: int, local_ranks: tuple[int, ...], placement: tuple[str, ...],
             engine_id: bytes = b"") -> None:
        """The membership's verdict: ready at `epoch` with these ranks on this daemon."""
        if self.net is not None:  # before the communicator, which takes this epoch's inbox
            self.net.begin_epoch(epoch)
        try:
            comm = self._engine.communicator(
                self.name, epoch, self.world_size, local_ranks, self.net,
                devices={r: self._devices.get(r, 0) for r in local_ranks}, unique_id=engine_id)
        except CallError as exc:  # (NCCL) this daemon cannot build its communicators
            log.error("world %s epoch %d: %s", self.name, epoch, exc.message, extra=self.log_extra())
            if self.net is not None:  # the other daemons formed it, or will: they must not wait
                self.epoch = epoch  # (their failure notice is about this epoch, not a stale one)
                self.membership.failed(exc.code, f"world {self.name} epoch {epoch}: daemon "
                                                 f"{self.net.me} cannot take part: {exc.message}")
            for rank in sorted(self._waiting):
                self.refuse(rank, exc.code, f"world {self.name} epoch {epoch}: {exc.message}")
            return
        self.epoch = epoch
        self.state = WorldState.READY
        self.stats.transition(self.state.value)
        self.cause, self.cause_code = None, ErrorCode.WORLD_FAILED
        self.local_ranks = local_ranks
        self.recorder.keep_only(local_ranks)
        self._matcher = Matcher(self.world_size, local_ranks)
        self._comm = comm
        self._extras.hand_to(comm)
        self.watchdog.ready()
        waiting, self._waiting = self._waiting, {}
        # A waiter the root placed elsewhere lost the race for its rank: never a member here
        strays = {rank: waiting.pop(rank) for rank in set(waiting) - set(local_ranks)}
        log.info("world %s epoch %d: ready, %d ranks (%d here)", self.name, epoch,
                 self.world_size, len(local_ranks), extra=self.log_extra())
        for rank, waiter in waiting.items():
            if waiter.timer is not None:
                waiter.timer.cancel()
            self.members[rank] = waiter.peer
        # All are members before any is told: a send that finds its peer gone fails the
        # world, and then every rank must be there to hear it.
        for _, waiter in sorted(waiting.items()):
            waiter.peer.send(
                _welcome(waiter.request_id, self._engine.name, self.epoch) if waiter.is_hello
                else proto.Ok(waiter.request_id, value=self.epoch)
            )
        for rank, waiter in sorted(strays.items()):
            if self.members.get(rank) is waiter.peer:
                # a rank of the last epoch whose vote lost the race: the rank is another
                # daemon's now, and this connection's end must not fail the world it runs in
                del self.members[rank]
                self._extras.forget(rank)
            where = placement[rank] if rank < len(placement) else "another daemon"
            self._cancel(waiter, ErrorCode.DUPLICATE_RANK,
                         f"rank {rank} of world {self.name} is on daemon {where}")

    # ---- calls ------------------------------------------------------------------

    def submit(self, rank: int, peer: Peer, request_id: int,
               calls: Sequence[tuple[proto.Op, tuple[Region | None, ...]]],
               events: EventPair | None = None, early: bool = False) -> None:
        """Enter one request's calls (of `rank`, on `peer`) into matching; the ticket replies
        when all ran."""
        if self.state is not WorldState.READY:
            raise CallError(self.cause_code, self._not_ready())
        # (the rank may be another connection's here now: its calls and their answers are its own)
        self._check_member(rank, peer)
        pending, count = self.pending_ops.get(rank, 0), len(calls)
        if pending + count > self._max_pending_ops:
            # (the request's own count said too: a group past the limit alone met "0 waiting")
            raise CallError(ErrorCode.LIMIT, f"rank {rank} has {pending} calls waiting for their "
                                             f"match and this request would add {count}; the "
                                             f"limit is {self._max_pending_ops}")
        self.pending_ops[rank] = pending + count
        ticket = Ticket(peer, rank, request_id, count, self.epoch)
        self.tickets.add(ticket)
        self.watchdog.call_opened()
        epoch = self.epoch
        for op, regions in calls:
            record = self.recorder.start(rank, op)
            ticket.records.append(record)
            try:
                match = self._matcher.add(Call(rank, op, Arrival(ticket, regions, record, events, early)))
            except Mismatch as exc:
                log.warning("world %s epoch %d: %s", self.name, self.epoch, exc,
                            extra=self.log_extra(rank))
                self.fail(ErrorCode.MISMATCH, str(exc))
                return
            if match is not None:
                arrivals = arrivals_of(match)
                if given_up(arrivals):
                    return  # (its world failed: the ticket has its error, as below)
                assert self._comm is not None
                spans_daemons = self.net is not None and len(self.local_ranks) < self.world_size
                self._runner.run(engine_op_of(match, spans_daemons), arrivals, self._comm, self.epoch)
                if self.state is not WorldState.READY or self.epoch != epoch:
                    return  # it failed meanwhile (a reply found its peer gone): the ticket has
                    # its error, and the group's other calls must not stay open in the next epoch

    def communicator(self) -> Communicator | None:
        """The ready epoch's communicator (None while the world forms or failed)."""
        return self._comm if self.state is WorldState.READY else None

    def ops_idle(self) -> None:
        """The engine has none of its ops left: a failed world's peer data has no op to take it."""
        if self.state is not WorldState.READY and self.net is not None:
            self.net.inbox.drop_unread()

    # ---- failure and departure ----------------------------------------------------

    def fail(self, code: ErrorCode, message: str, propagate: bool = True,
             rank: int | None = None) -> None:
        """READY → FAILED: abort, fail every pending call, tell every rank and (with
        `propagate`) the other daemons of the world. `rank`: the one the failure is about,
        if one is (for the logs)."""
        if self.state is not WorldState.READY:
            return
        message = clip(message, MAX_CAUSE)
        self.state = WorldState.FAILED
        self.cause, self.cause_code = message, code
        self.stats.transition("failed")
        # An ending is how jobs end; only a failure that hits calls warns. Calls waiting for
        # their match are lost; those the engine runs end on their own, and may well end
        # done: across daemons, the root's rank that left first ends the world while this
        # daemon's rank's last op still takes in its result (seen: 1 in 20 jobs of 17 MiB
        # all_reduces warned "failed", their calls all right). Their end tells which it was.
        lost = any(ticket.remaining > ticket.executing for ticket in self.tickets)
        failed = lost or code not in _ENDINGS
        end = _End(self.epoch, code, message, self.log_extra(rank),
                   list(self.recorder.lines()) if failed or self.tickets else [])
        if failed or not self.tickets:
            self._tell(end, failed)
        else:
            end.running = set(self.tickets)
            self.unsettled.append(end)
        if self._comm is not None:
            self._runner.retire(self._comm)
            self._comm = None
        if self.net is not None:
            self.net.inbox.fail(CallError(code, message))
            if not self._runner.queued:  # no op left to take what came
                self.net.inbox.drop_unread()
            if propagate:
                self.membership.failed(code, message)
        tickets, self.tickets = self.tickets, set()
        self.pending_ops.clear()
        for ticket in tickets:
            if ticket.remaining > ticket.executing:  # a call still waiting for its match: lost
                ticket.fail_when_idle(code, self.call_failed())
            if not ticket.done:
                self.tickets.add(ticket)  # ops of it in the engine: their end answers it
        self.recorder.end_deadlines()
        self._matcher = Matcher(self.world_size, self.local_ranks)
        event = proto.Event(proto.EventKind.WORLD_FAILED, code, message, self.epoch)
        for peer in list(self.members.values()):  # a send may close a peer and shrink members
            peer.send(event)

    def settle(self, ticket: Ticket, failure: tuple[ErrorCode, str] | None) -> None:
        """An op of `ticket` ended, after an ending came with it running (see fail): one that
        failed makes that ending a failure; once all of them are done, it was the job's end."""
        for end in list(self.unsettled):
            if ticket not in end.running or (failure is None and not ticket.done):
                continue
            end.running.discard(ticket)
            if failure is not None or not end.running:
                self.unsettled.remove(end)
                self._tell(end, failed=failure is not None)

    def _tell(self, end: _End, failed: bool) -> None:
        if failed:
            # (an op that ended after its world was forgotten is counted, not kept as the world's
            # last failure: no status shows a forgotten world's, and nothing would drop it)
            self.stats.count_failure(self.name, end.epoch, end.code, end.message, keep=not self.forgotten)
        # (said as "ended", not "failed": operators search the logs for failures)
        how = "failed" if failed else "ended, no call pending"
        log.log(logging.WARNING if failed else logging.INFO, "world %s epoch %d: %s: %s", self.name,
                end.epoch, how, end.message, extra=end.extra)
        for line in end.recorder_lines if failed else ():
            log.warning("world %s epoch %d flight recorder: %s", self.name, end.epoch, line, extra=end.extra)

    # (what a rank asks of the engine, by the rank's connection only: the keys of another's
    # registrations, numbered by its own connection, would name this one's)

    def set_add_kernel(self, rank: int, peer: Peer, handle: int) -> None:
        self._check_member(rank, peer)
        self._extras.set_add_kernel(rank, handle, self._comm)

    def register(self, rank: int, peer: Peer, key: int, region: Region) -> None:
        """register_buffer: the engine may prepare the memory (NCCL registers it)."""
        self._check_member(rank, peer)
        self._extras.register(rank, key, region, self._comm)

    def deregister(self, rank: int, peer: Peer, key: int) -> None:
        if self.members.get(rank) is peer:  # (another's registration was never the world's)
            self._extras.deregister(rank, key, self._comm)

    def leave(self, rank: int, peer: Peer) -> None:
        """A rank's connection is gone (closed, killed, or refused)."""
        waiter = self._waiting.get(rank)
        if waiter is not None and waiter.peer is peer:
            if waiter.timer is not None:
                waiter.timer.cancel()
            del self._waiting[rank]
            self.membership.withdraw(rank)
        if self.members.get(rank) is peer:
            del self.members[rank]
            self._extras.forget(rank)
            self.fail(ErrorCode.WORLD_FAILED, f"rank {rank}'s connection was lost", rank=rank)
        self.forget_if_empty()

    def shutdown(self, message: str) -> None:
        """The daemon stops: every pending call and waiter gets SHUTDOWN. A ready world
        fails with it first: the daemon closes its ranks' connections one by one next, and
        the first departure would otherwise fail the world under the others with "rank N's
        connection was lost". The other daemons' ranks lost a peer, which can come back.
        A call with an op in the engine's hands goes unanswered: the op may write the worker's
        memory until the engine closes, after the answer would have gone, and a worker told
        its call failed takes its buffers back at once; with the connection closed unanswered,
        it first moves them off the memory the daemon still has (as when a daemon dies)."""
        # (what is left, calls waiting for their match, only a ready world has: its failure
        # answers them)
        self.tickets = {ticket for ticket in self.tickets if not ticket.executing}
        unsettled, self.unsettled = self.unsettled, []
        for end in unsettled:  # (their calls go unanswered, as above)
            self._tell(end, failed=True)
        if self.state is WorldState.READY:
            self.fail(ErrorCode.SHUTDOWN, message, propagate=False)
            if self.net is not None:
                self.membership.failed(ErrorCode.PEER_LOST, f"daemon {self.net.me} is shutting down")
        stopped = f"world {self.name} is not ready: {message}"
        # Swapped out first: a reply can close its connection, whose departure edits them
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            # (a hello's rank has no backend yet to reconnect: its join is what it makes again)
            advice = "join again" if waiter.is_hello else "call attempt_reconnect"
            self._cancel(waiter, ErrorCode.SHUTDOWN, f"{stopped}; {advice} once it is back")
        self._runner.abort_all(self._comm)
        self._comm = None

    def forget_if_empty(self) -> None:
        """No rank here, none waiting, and (root) no other daemon's rank voting: the world
        is over on this daemon."""
        if not self.members and not self._waiting and not self.membership.voting():
            self.watchdog.stop()
            if self._comm is not None:
                self._comm.abort()
                self._comm = None
            self.forgotten = True
            self._on_empty(self)

    def log_extra(self, rank: int | None = None) -> dict[str, object]:
        """Fields for structured (JSON) logs; built only on lines that are logged anyway."""
        extra: dict[str, object] = {"world": self.name, "epoch": self.epoch}
        if rank is not None:
            extra["rank"] = rank
        return extra

    def _check_member(self, rank: int, peer: Peer) -> None:
        """Refuse a request of a connection that is not (or no longer) the rank's member here:
        a rebuild placed the rank on another daemon, or another connection took it since."""
        if self.members.get(rank) is peer:
            return
        net = self.net
        if net is not None and rank < len(net.placement) and net.placement[rank] != net.me:
            raise CallError(ErrorCode.DUPLICATE_RANK, f"rank {rank} of world {self.name} is on daemon "
                                                      f"{net.placement[rank]}")
        raise CallError(ErrorCode.DUPLICATE_RANK, f"rank {rank} of world {self.name} is not this "
                                                  "connection's: another holds it, or its hello was refused")

    def call_failed(self) -> str:
        """What a call the world's failure ended says: a worker may be in several worlds,
        and what to do next is the same for every cause but this daemon's stop, where
        the daemon has to be back first (as every other word of the stop says)."""
        advice = "once it is back" if self.cause_code is ErrorCode.SHUTDOWN else "on every rank"
        return framed(f"world {self.name} epoch {self.epoch} failed: ", str(self.cause),
                      f"; call attempt_reconnect {advice}")

    def _not_ready(self) -> str:
        if self.cause is None:
            return f"world {self.name} is {self.state.value}; wait for every rank to join"
        return framed(f"world {self.name} epoch {self.epoch} failed: ", self.cause,
                      f"; call attempt_reconnect ({len(self._waiting)}/{self.world_size} ranks have)")

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "state": self.state.value,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "ranks": sorted(self.members),
            "waiting": sorted(self._waiting),
            "votes_held": self.membership.votes_held(),  # (the root's, of every daemon's ranks)
            "pending_calls": len(self.tickets),
            # received from other daemons, not yet taken by an op (bounded by the senders' windows)
            "peer_bytes_held": self.net.inbox.held_bytes if self.net is not None else 0,
            "cause": self.cause,
            "add_kernel": {str(rank): handle for rank, handle in sorted(self._extras.add_kernel.items())},
            "call_timeout_s": self.call_timeout_s,
            "recent_calls": self.recorder.dump(last=8),
        }


def _welcome(request_id: int, engine: str, epoch: int) -> proto.Welcome:
    from . import __version__

    return proto.Welcome(request_id, proto.PROTOCOL_VERSION, __version__, engine, epoch,
                         proto.MAX_MESSAGE_BYTES)
