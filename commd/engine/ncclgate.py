"""Where the NCCL calls that may wait for the device run: off the event loop, alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .stuckwatch import StuckWatch

log = logging.getLogger("commd.engine.nccl")


class NcclGate:
    """ncclCommAbort and ncclMemFree may wait for the device as long as a kernel there
    runs (another world's; one waiting for a dead worker's event). They run here, one at a
    time on a thread of their own, each watched by the StuckWatch, so that the event loop
    (every other world, the peer links, the clients) goes on meanwhile.

    NCCL allows no other NCCL call while an abort runs, on any communicator, and the loop
    makes all the others: while an abort runs (or waits its turn here) the gate is closed.
    The loop's async paths wait for it (`opened`) and its polls skip a round (`closed`);
    the few synchronous ones (a communicator's init, ncclGetUniqueId, ncclMemAlloc) block
    the loop until it opens (`wait`), told to the peers first like any stall the watch
    bounds. An ncclMemFree only has to keep out of an abort's way, which this one thread
    sees to: it leaves the gate open (closing it, a free waiting for a kernel that waits
    for a launch of the loop's would hold both for ever)."""

    def __init__(self, stuck: StuckWatch) -> None:
        self._stuck = stuck
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="commd-nccl-wait")
        self._aborts: list[concurrent.futures.Future[None]] = []  # the jobs that close the gate
        self._closing = False
        self._running: tuple[str, float] | None = None  # the job on the thread now, since when

    @property
    def closed(self) -> bool:
        self._aborts = [job for job in self._aborts if not job.done()]
        return bool(self._aborts)

    def run(self, what: str, job: Callable[[], None], *, then: Callable[[], None] | None = None,
            closes: bool = True) -> None:
        """Run `job` (which NCCL calls: `what`) behind the jobs before it, the gate closed
        meanwhile if it `closes`; `then` follows on the event loop. Without a running loop
        (a daemon closing) both run here, now."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self._closing:
            self.wait()
            self._guarded(what, job)
            if then is not None:
                then()
            return
        done = self._thread.submit(self._guarded, what, job)
        if closes:
            self._aborts.append(done)
        if then is not None:
            asyncio.wrap_future(done, loop=loop).add_done_callback(lambda _: then())

    def holding(self) -> str | None:
        """What the thread runs now, and for how long (for `commd status`), or None."""
        running = self._running  # (set by the thread: read once)
        if running is None:
            return None
        waiting = sum(1 for job in self._aborts if not job.running() and not job.done())
        return (f"{running[0]} running for {time.monotonic() - running[1]:.1f} s"
                + (f", {waiting} more abort{'s' if waiting > 1 else ''} waiting" if waiting else ""))

    async def opened(self) -> None:
        while self.closed:
            await asyncio.wait([asyncio.wrap_future(job) for job in self._aborts])

    def wait(self) -> None:
        """Block this thread (the loop's, for a synchronous NCCL call) until the gate opens.
        Each abort may take the watch's whole limit: the stall is told again for each."""
        while self.closed:
            self._stuck.stall()
            concurrent.futures.wait(self._aborts, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Let the jobs asked so far finish; later ones run on the caller's thread."""
        self._closing = True
        self._thread.shutdown(wait=True)

    def _guarded(self, what: str, job: Callable[[], None]) -> None:
        self._running = (what, time.monotonic())
        try:
            with self._stuck.guard(what):
                job()
        except Exception:  # nobody awaits the job: its failure is logged, not lost
            log.exception("%s failed", what)
        finally:
            self._running = None
