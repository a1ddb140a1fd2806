"""A world's watchdog: fails the world when its engine reports an error of its own
(NCCL's async errors), or when a call stays open past the world's call timeout (a rank
that never made its matching call, or an engine that never finished)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto import ErrorCode, clip_text
from proto import peer as p

from .errors import CallError, named_ranks

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger("commd.world")
# How often a watched world asks its engine for async errors and checks call deadlines:
# bounds the detection of an engine failure; one cheap wake-up per world.
_WATCH_S = 0.25
# ... and at most this often, however short a world's call timeout (a hello may ask for 1 ms):
# a timeout is then noticed up to this late, and no world can keep the loop busy.
_MIN_WATCH_S = 0.05
# How long a timeout in a world across daemons waits for the other daemons' word on their ranks'
# calls (less if the peer window is shorter): one that answers does within milliseconds, and
# one that is stuck must not hold the failure back longer than this (nor past the client's
# _VERDICT_GRACE_S, 2 s, after which a rank stops waiting for the daemon's word and says less).
_ASK_S = 1.0
# A daemon's watch asks at most once a watch interval (_MIN_WATCH_S at the least), so a daemon
# that asks more often is broken or hostile; each answer costs O(ranks), and a member's query
# the root passes on to every other member (M daemons asking together: M·(M−1) answers). Half
# the interval leaves room for two honest questions the network delivered together.
_MIN_ASK_GAP_S = _MIN_WATCH_S / 2
_NO_CALL = "no call yet"


@dataclass(slots=True)
class _Ask:
    """One question to the other daemons of the world: who has yet to answer, what was said."""

    id: int
    pending: set[str]
    answered: asyncio.Future[None]
    heard: dict[str, p.CallsReport] = field(default_factory=dict)
    unasked: set[str] = field(default_factory=set)  # no link to send the question over


class Watchdog:
    """One world's watch, from its first ready epoch until it empties. An idle world is not
    watched on a timer: it waits until a call opens or an engine that reports errors of
    its own comes (hundreds of idle worlds on one daemon would wake it thousands of times
    a second for nothing)."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._task: asyncio.Task[None] | None = None
        self._wanted = asyncio.Event()  # set: there may be something to watch
        self._asks = itertools.count(1)
        self._asking: _Ask | None = None
        self._last_answered: dict[str, float] = {}  # by asker (the world's daemons only)

    def ready(self) -> None:
        """The world is ready (again), maybe with an engine that must be polled."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())
        self._wanted.set()

    def call_opened(self) -> None:
        self._wanted.set()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        world = self._world
        timeout_s = world.call_timeout_s  # (recv_command_u32 has no deadline: never open here)
        interval = _WATCH_S if timeout_s is None else max(_MIN_WATCH_S, min(_WATCH_S, timeout_s / 4))
        while True:  # cancelled when the world empties
            if not self._watched():
                self._wanted.clear()
                await self._wanted.wait()
            await asyncio.sleep(interval)
            comm = world.communicator()
            if comm is None:
                continue
            try:
                error = comm.async_error()
            except Exception as exc:  # asking failed: as bad as an error, and the watch goes on
                error = f"could not read the engine's state: {type(exc).__name__}: {exc}"
            if error is not None:
                log.error("world %s epoch %d: the engine failed: %s", world.name, world.epoch, error,
                          extra=world.log_extra())
                world.fail(ErrorCode.ENGINE, f"engine error: {error}")
                continue
            if timeout_s is None:
                continue
            oldest = world.recorder.oldest_open()
            if oldest is not None and time.monotonic() - oldest.started > timeout_s:
                await self._timed_out(timeout_s)

    async def _timed_out(self, timeout_s: float) -> None:
        world = self._world
        epoch = world.epoch
        ask, waited_s = await self._ask_others()
        # The call that timed out may have ended while we asked; another past its deadline by
        # now fails the world at once, on what was just heard (asking again would answer it
        # up to a second later still, maybe past its client's grace for the verdict)
        oldest = world.recorder.oldest_open()
        if oldest is None or time.monotonic() - oldest.started <= timeout_s or world.epoch != epoch:
            return  # (or the world failed meanwhile: another daemon's watchdog said it)
        newest = "; ".join(self._newest(ask, waited_s))
        world.fail(ErrorCode.TIMEOUT,
                   f"rank {oldest.rank}'s call #{oldest.seq} {oldest.call} did not complete "
                   f"within {timeout_s:g}s (each rank's newest call: {newest})", rank=oldest.rank)

    def _watched(self) -> bool:
        """Whether there is anything to look at now."""
        world = self._world
        comm = world.communicator()
        if comm is not None and comm.reports_async_errors:
            return True
        return world.call_timeout_s is not None and world.recorder.oldest_open() is not None

    async def _ask_others(self) -> tuple[_Ask, float]:
        """The other daemons' answers (by daemon) to a CallsQuery, and how long we waited for
        them: the root asks each member; a member asks the root, which passes the query on."""
        world, net = self._world, self._world.net
        ask = _Ask(next(self._asks), set(net.members()) if net is not None else set(),
                   asyncio.get_running_loop().create_future())
        if net is None or not ask.pending:
            return ask, 0.0
        wait_s = min(_ASK_S, net.cluster.settings.window_s)
        query = p.CallsQuery(world.name, world.epoch, ask.id, net.me)
        self._asking = ask
        try:
            for daemon in net.members() if net.is_root else ["root"]:
                try:
                    net.send(daemon, query)
                except CallError:  # (unreachable: nothing to wait for from there; a member
                    # asks every other daemon through the root)
                    unasked = {daemon} if net.is_root else set(ask.pending)
                    ask.pending -= unasked
                    ask.unasked |= unasked
            if ask.pending:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await ask.answered
        finally:
            self._asking = None
        return ask, wait_s

    def reported(self, report: p.CallsReport) -> None:
        """A daemon's answer to our question (the registry checked who sent it)."""
        ask = self._asking
        if ask is None or report.ask != ask.id or report.daemon not in ask.pending:
            return
        ask.pending.discard(report.daemon)
        ask.heard[report.daemon] = report
        if not ask.pending and not ask.answered.done():
            ask.answered.set_result(None)

    def report(self, query: p.CallsQuery) -> p.CallsReport | None:
        """This daemon's answer to another's CallsQuery: its ranks' newest calls; None if
        the same daemon asked under _MIN_ASK_GAP_S ago (then it is not passed on either)."""
        now = time.monotonic()
        if now - self._last_answered.get(query.asker, -math.inf) < _MIN_ASK_GAP_S:
            return None
        self._last_answered[query.asker] = now
        world = self._world
        assert world.net is not None
        calls, ranks, call_of = by_call(self._here())
        return p.CallsReport(world.name, world.epoch, query.ask, query.asker, world.net.me, calls, ranks,
                             call_of)

    def _here(self) -> dict[str, list[int]]:
        """Each of this daemon's ranks' newest call, by call; a rank the flight recorder has
        no call of (the one behind may be among them) as having made none."""
        world = self._world
        calls = world.recorder.newest()  # (of the ranks placed here: see FlightRecorder.keep_only)
        recorded = world.recorder.ranks()  # (a copy: asked once, not once a rank)
        idle = [r for r in world.local_ranks if r not in recorded]
        if idle:
            calls.setdefault(_NO_CALL, []).extend(idle)
        return calls

    def _newest(self, ask: _Ask, waited_s: float) -> list[str]:
        """For a timeout's message, every rank's newest call, grouped by call across daemons
        (by call: said a rank at a time, the rank behind came after every rank at the others'
        call, and past a few dozen ranks the message was clipped before it)."""
        world, net = self._world, self._world.net
        calls = self._here()
        unknown = []
        for daemon in net.members() if net is not None else []:
            assert net is not None
            theirs = net.ranks_of(daemon)
            report = ask.heard.get(daemon)
            told: dict[int, str] = {}
            if report is not None:  # (a daemon speaks for its own ranks only)
                mine = set(theirs)
                told = {rank: report.calls[i] for rank, i in zip(report.ranks, report.call_of, strict=True)
                        if rank in mine}
            for rank, call in told.items():
                calls.setdefault(call, []).append(rank)
            untold = [r for r in theirs if r not in told]
            if untold:
                why = (f"on daemon {daemon}, not in its answer" if report is not None else
                       f"daemon {daemon} could not be asked (no link)" if daemon in ask.unasked else
                       f"daemon {daemon} did not answer within {waited_s:g}s")
                unknown.append(f"{named_ranks(untold)}: {why} (`commd status --world {world.name}` there "
                               f"shows {'its' if len(untold) == 1 else 'their'} calls)")
        ordered = sorted(((sorted(ranks), call) for call, ranks in calls.items()), key=lambda g: g[0][0])
        return [*(f"{named_ranks(ranks)}: {call}" for ranks, call in ordered), *unknown]


def by_call(groups: dict[str, list[int]]) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """A CallsReport's `calls`, `ranks` and `call_of` for ranks grouped by call, within its
    bounds: the ranks of the calls past MAX_CALL_GROUPS are told as at one of those."""
    items = list(groups.items())
    if len(items) > p.MAX_CALL_GROUPS:
        rest = items[p.MAX_CALL_GROUPS - 1:]
        items[p.MAX_CALL_GROUPS - 1:] = [(f"one of {len(rest)} other calls",
                                          sorted(rank for _, ranks in rest for rank in ranks))]
    ranks: list[int] = []
    call_of: list[int] = []
    for index, (_, of) in enumerate(items):
        ranks += of
        call_of += [index] * len(of)
    return tuple(clip_text(call, p.MAX_CALL_TEXT) for call, _ in items), tuple(ranks), tuple(call_of)

