"""Frees the objects of worlds that ended. A world's parts point back at it (its
membership, op runner and watchdog hold the world), so reference counting never frees
one: only the cyclic collector does. The
daemon runs that collector rarely (daemon._tune_gc: young objects every 50 000
allocations, old ones every 400 young collections), and a world that lived through a young
collection (anything longer than a moment, or a failed one whose communicator has its
abort grace) then waited for an old-generation collection: hundreds of thousands of worlds
that end, each a few KB (seen as a root daemon's RSS rising ~6 KB a world for thousands of
worlds that failed in the middle of a call, s30/N)."""

from __future__ import annotations

import asyncio
import gc
import math

# A full collection walks every object the daemon made since start-up (~30 ms for 200 000
# on this project's 2-core test machine) with the event loop stopped, so it runs at most
# this often, and only while worlds end: under the fastest churn measured (~130 worlds a
# second failing mid-call, a hostile peer's) what waits for it stays under ~25 MB (s30/M's
# campaign: the root's RSS rose to 76.6 MB in the first 30 s, then stayed there).
SWEEP_AFTER_S = 30.0


class WorldSweep:
    """One full collection a while after worlds are forgotten, however many end meanwhile:
    what start-up built is frozen, so it walks only what the daemon made since, and at
    most once per SWEEP_AFTER_S (none while no world ends), and no sooner after the first
    world's end than `at_least_s`: long enough for what still holds a forgotten world to
    let go (a retired communicator's abort grace, its op's last failure told). A world
    forgotten less than `at_least_s` before a collection may still be held at it, so
    another follows (it would otherwise wait for the next world's end, maybe for ever)."""

    def __init__(self, at_least_s: float) -> None:
        self._at_least_s = at_least_s
        self._delay_s = max(SWEEP_AFTER_S, at_least_s)
        self._timer: asyncio.TimerHandle | None = None
        self._last_forgotten = -math.inf  # (the loop's clock)
        # the armed collection's time less `at_least_s`: a world forgotten later may be held
        self._covers_until = -math.inf
        self._closed = False

    def world_forgotten(self) -> None:
        if self._closed:  # (the daemon's stop forgets its worlds after closing this)
            return
        loop = asyncio.get_running_loop()
        self._last_forgotten = loop.time()
        if self._timer is None:
            self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(self._delay_s, self._sweep)
        self._covers_until = loop.time() + self._delay_s - self._at_least_s

    def _sweep(self) -> None:
        self._timer = None
        gc.collect()
        if self._last_forgotten > self._covers_until:
            self._arm(asyncio.get_running_loop())

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
