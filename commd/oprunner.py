"""A world's matched ops in the engine's hands: each run inline or in its turn, its calls
answered when it ends, and the communicators of failed epochs aborted once none of their
ops runs any more."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING

from proto import ErrorCode

from .engine.base import Communicator, EngineOp, RecvOp, SendOp, StillOnDevice
from .errors import CallError
from .tasks import HeldTasks
from .tickets import Arrival, Ticket, order_of

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger("commd.world")
# How long the ops of a failed world may go on finishing before its communicator is aborted
# under them: long enough for ops every rank joined, short enough to free a hung one.
ABORT_GRACE_S = 2.0


def given_up(arrivals: list[Arrival]) -> bool:
    """Whether a rank of a match (its `arrivals`) hung up (the world fails for it): its client gave
    up on the call (CommTimeout, an interrupt) and drops its connection before it says
    so, and may write, reuse or free the buffers the op would write. The daemon reads
    a packet a wakeup, so other ranks' calls may match it before the hang-up is read:
    it is looked for before the op starts (what started before goes on). A rank that
    left earlier (killed) has its op not started either: its world failed already."""
    # (every one looked at: each hung-up connection closes, and leaves the world)
    return any([arrival.ticket.peer.close_if_hung_up() for arrival in arrivals])


class OpRunner:
    """One world's ops from their match until their calls are answered, across its epochs."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._lock = asyncio.Lock()
        self._executing = HeldTasks()
        self.queued = 0  # matched ops waiting for or holding _lock
        # Communicators of failed epochs whose ops are still in the engine: aborted when those
        # finish, or after ABORT_GRACE_S at the latest (an op waiting on a lost peer never does).
        self._abort_when_idle: set[Communicator] = set()

    def run(self, engine_op: EngineOp | None, arrivals: list[Arrival], comm: Communicator,
            epoch: int) -> None:
        """Run a matched op: inline when nothing is queued and it is small, else in order.

        From here the op belongs to the engine: if the world fails meanwhile, it still
        completes (or fails) on its own, so calls every rank already made are not
        failed by a rank that left after making them; unless it waits its turn, and one
        of its own ranks leaves meanwhile (see given_up)."""
        for arrival in arrivals:
            arrival.ticket.executing += 1
            arrival.record.state = "running"
        if self.queued == 0:
            try:
                done = engine_op is None or comm.try_inline(engine_op)
            except Exception as exc:
                self._op_failed(arrivals, exc, epoch)
                return
            if done:
                self._finish(arrivals)
                return
        self.queued += 1
        # Sends and receives to other daemons are paired there, not here: they must not
        # queue behind each other (a group's send and recv would wait for one another).
        ordered = not isinstance(engine_op, SendOp | RecvOp) and not comm.launches_in_order
        self._executing.spawn(self._execute(arrivals, engine_op, comm, epoch, ordered))

    async def _execute(self, arrivals: list[Arrival], engine_op: EngineOp | None, comm: Communicator,
                       epoch: int, ordered: bool) -> None:
        try:
            async with self._lock if ordered else contextlib.nullcontext():
                if engine_op is not None and given_up(arrivals):  # (while it waited its turn)
                    raise CallError(ErrorCode.WORLD_FAILED, "a rank of the call left before it started")
                if engine_op is not None:
                    await comm.run(engine_op, order_of(arrivals), frozenset(a.ticket for a in arrivals))
        except Exception as exc:
            self._op_failed(arrivals, exc, epoch)
            return
        finally:
            self.queued -= 1
            if self.queued == 0:  # those still busy with early-answered ops: the grace decides
                idle = {old for old in self._abort_when_idle if not old.busy()}
                self._abort_when_idle -= idle
                for old in idle:
                    old.abort()
                self._world.ops_idle()
        self._finish(arrivals)

    def _op_failed(self, arrivals: list[Arrival], exc: Exception, epoch: int) -> None:
        """The engine could not complete an op: its world fails (if this epoch still
        stands), and the op's own calls (its `arrivals`) get the error."""
        world = self._world
        if isinstance(exc, CallError):
            code, message = exc.code, exc.message
        else:
            log.error("world %s epoch %d: engine failed", world.name, world.epoch, exc_info=exc,
                      extra=world.log_extra())
            code, message = ErrorCode.INTERNAL, f"engine error: {type(exc).__name__}: {exc}"
        if epoch == world.epoch:
            world.fail(code, message)
            code, message = world.cause_code, world.call_failed()
        past = exc.past if isinstance(exc, StillOnDevice) else {}
        for arrival in arrivals:
            left = past.get(arrival.ticket.rank)
            if left is None or left.done():
                self._op_ended(arrival.ticket, (code, message))
            else:  # the op may still touch this rank's memory until its stream is past it
                left.add_done_callback(functools.partial(self._op_ended, arrival.ticket, (code, message)))

    def _op_ended(self, ticket: Ticket, failure: tuple[ErrorCode, str] | None = None,
                  _past: object = None) -> None:
        ticket.op_ended(failure)
        if ticket.done:
            self._world.tickets.discard(ticket)
        if self._world.unsettled:
            self._world.settle(ticket, failure)

    def _finish(self, arrivals: list[Arrival]) -> None:
        world = self._world
        for arrival in arrivals:
            ticket = arrival.ticket
            # (cleared when the world failed: one of an older epoch is counted no more)
            if ticket.epoch == world.epoch and world.pending_ops.get(ticket.rank):
                world.pending_ops[ticket.rank] -= 1
            arrival.record.close("done")
            self._op_ended(ticket)

    def retire(self, comm: Communicator) -> None:
        """A failed epoch's communicator: ops in the engine's hands finish first (see run)."""
        if self.queued or comm.busy():
            self._abort_when_idle.add(comm)
            asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._abort_late, comm)
        else:
            comm.abort()

    def abort_all(self, current: Communicator | None) -> None:
        """The daemon stops: every communicator goes now, `current` (the ready epoch's) too
        (no grace: the engine closes next)."""
        for comm in [*self._abort_when_idle, *([current] if current is not None else [])]:
            comm.abort()
        self._abort_when_idle.clear()

    def _abort_late(self, comm: Communicator) -> None:
        if comm in self._abort_when_idle:
            self._abort_when_idle.discard(comm)
            comm.abort()
