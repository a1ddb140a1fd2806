"""Frees the objects of worlds that ended. A world's parts point back at it (its
membership, op runner and watchdog hold the world; its failure's traceback holds frames
that hold it), so reference counting never frees one: only the cyclic collector does. The
daemon runs that collector rarely (daemon._tune_gc: young objects every 50 000
allocations, old ones every 400 young collections), and a world that lived through a young
collection (anything longer than a moment, or a failed one whose communicator has its
abort grace) then waited for an old-generation collection: hundreds of thousands of worlds
that end, each a few KB (seen as a root daemon's RSS rising ~6 KB a world for thousands of
worlds that failed in the middle of a call, s30/N)."""

from __future__ import annotations

import asyncio
import gc


class WorldSweep:
    """One full collection a while after worlds are forgotten, however many end meanwhile:
    what start-up built is frozen, so it walks only what the daemon made since, and at
    most once per `delay_s` (none while no world ends)."""

    def __init__(self, delay_s: float) -> None:
        # (long enough for what still holds a forgotten world to let go: a retired
        # communicator's abort grace, its op's last failure told)
        self._delay_s = delay_s
        self._timer: asyncio.TimerHandle | None = None

    def world_forgotten(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        gc.collect()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
