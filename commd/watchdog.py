"""A world's watchdog: fails the world when its engine reports an error of its own
(NCCL's async errors), or when a call stays open past the world's call timeout (a rank
that never made its matching call, or an engine that never finished)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from proto import ErrorCode

from .errors import rank_list

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger("commd.world")
# How often a watched world asks its engine for async errors and checks call deadlines:
# bounds the detection of an engine failure; one cheap wake-up per world.
_WATCH_S = 0.25
# ... and at most this often, however short a world's call timeout (a hello may ask for 1 ms):
# a timeout is then noticed up to this late, and no world can keep the loop busy.
_MIN_WATCH_S = 0.05


class Watchdog:
    """One world's watch, from its first ready epoch until it empties. An idle world is not
    watched on a timer: it waits until a call opens or an engine that reports errors of
    its own comes (hundreds of idle worlds on one daemon would wake it thousands of times
    a second for nothing)."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._task: asyncio.Task[None] | None = None
        self._wanted = asyncio.Event()  # set: there may be something to watch

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
                # (by call: said a rank at a time, the rank behind came after every rank at the
                # others' call, and past a few dozen ranks the message was clipped before it)
                calls = [f"{_who(ranks)}: {call}" for call, ranks in world.recorder.newest().items()]
                newest = "; ".join([*calls, *self._unrecorded()])
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

    def _unrecorded(self) -> list[str]:
        """For a timeout's message, the ranks the flight recorder has no call of: the one
        behind may be among them, and a rank of another daemon is seen only there."""
        world = self._world
        recorded = world.recorder.ranks()
        idle = [r for r in world.local_ranks if r not in recorded]
        lines = [f"{_who(idle)}: no call yet"] if idle else []
        if world.net is None:
            return lines
        for daemon in world.net.members():
            ranks = list(world.net.ranks_of(daemon))
            lines.append(f"{_who(ranks)}: on daemon {daemon}, no call known here (`commd status --world "
                         f"{world.name}` there shows {'its' if len(ranks) == 1 else 'their'} calls)")
        return lines


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"
