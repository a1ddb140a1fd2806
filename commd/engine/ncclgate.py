"""Where the NCCL calls that may wait for the device run: off the event loop, alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
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
    makes all the others: while an abort runs the gate is closed. The abort's thread asks
    the loop to close it and starts once the loop did, in a callback of its own, so never
    in the middle of the loop's NCCL calls (which hold no await). Then the loop's async
    paths wait for it (`opened`) and its polls skip a round (`closed`); the few synchronous
    ones (a communicator's init, ncclGetUniqueId, ncclMemAlloc) block the loop until that
    abort returned (`wait`), told to the peers first. An abort still waiting its turn
    keeps the gate open: behind an ncclMemFree that waits for a kernel that waits for a
    launch of the loop's, a closed gate would hold all three for ever. An ncclMemFree
    only has to keep out of an abort's way, which this one thread sees to."""

    def __init__(self, stuck: StuckWatch) -> None:
        self._stuck = stuck
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="commd-nccl-wait")
        self._open = threading.Event()
        self._open.set()
        self._openers: list[asyncio.Future[None]] = []  # the loop's waits for the gate
        self._asking: threading.Event | None = None  # the abort waiting for the loop to close it
        self._aborts: list[concurrent.futures.Future[None]] = []  # (for `holding`)
        self._jobs: list[concurrent.futures.Future[None]] = []  # all, for a wait without a loop
        self._closing = False
        self._running: tuple[str, float] | None = None  # the job on the thread now, since when
        self._follow_ups: list[_Once] = []  # the `then`s not yet run (close runs them)

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

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
        if closes:
            done = self._thread.submit(self._exclusive, loop, what, job)
            self._aborts = [abort for abort in self._aborts if not abort.done()] + [done]
        else:
            done = self._thread.submit(self._guarded, what, job)
        self._jobs = [other for other in self._jobs if not other.done()] + [done]
        if then is not None:
            follow_up = _Once(then)
            self._follow_ups = [f for f in self._follow_ups if not f.ran] + [follow_up]
            asyncio.wrap_future(done, loop=loop).add_done_callback(lambda _: follow_up())

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
            opener = asyncio.get_running_loop().create_future()
            self._openers.append(opener)
            await opener

    def wait(self) -> None:
        """Block this thread until it may make NCCL calls. On the loop's (a synchronous
        NCCL call): until the running abort returned, none other starting meanwhile, since
        the loop lets each start. Without a running loop (a daemon closing, a test): until
        every job asked so far is done; they start without asking a loop that runs no more."""
        if not loop_running():
            concurrent.futures.wait(self._jobs)
            return
        if self.closed:
            self._stuck.stall()
            self._open.wait()

    def close(self) -> None:
        """Let the jobs asked so far finish (called on the loop's thread, which makes no
        NCCL call meanwhile, so aborts need not ask it), then run their `then`s here;
        later ones run on the caller's. An abort's `then` tears its communicators down:
        left to the loop, it would let go of their memory after the engine closed (after
        the workers heard of the stop, or never, once the loop stopped)."""
        self._closing = True
        asking = self._asking
        if asking is not None:
            asking.set()
        self._thread.shutdown(wait=True)
        follow_ups, self._follow_ups = self._follow_ups, []
        for follow_up in follow_ups:
            try:
                follow_up()
            except Exception:  # as the loop would: logged, and the others still run
                log.exception("what followed an NCCL call of the gate failed")

    def _exclusive(self, loop: asyncio.AbstractEventLoop, what: str, job: Callable[[], None]) -> None:
        """An abort, on the thread: once the loop closed the gate, and open it after."""
        asking = threading.Event()
        self._asking = asking  # (before _closing is read: see close)
        try:
            if not self._closing:
                try:
                    loop.call_soon_threadsafe(self._close_for, asking)
                except RuntimeError:  # the loop is gone (a daemon ending): it calls no NCCL now
                    pass
                else:
                    while not asking.wait(0.05):
                        if not loop.is_running():  # stopped: it calls no NCCL now either
                            self._open.clear()
                            asking.set()  # (its callback, should it run later, does nothing)
            self._guarded(what, job)
        finally:
            self._asking = None
            self._open.set()
            with contextlib.suppress(RuntimeError):  # (the loop is gone: nobody waits)
                loop.call_soon_threadsafe(self._wake)

    def _close_for(self, asking: threading.Event) -> None:
        """On the loop, between its callbacks: no NCCL call of its is half made."""
        if not asking.is_set():  # (close() let it start already)
            self._open.clear()
            asking.set()

    def _wake(self) -> None:
        openers, self._openers = self._openers, []
        for opener in openers:
            if not opener.done():
                opener.set_result(None)

    def _guarded(self, what: str, job: Callable[[], None]) -> None:
        self._running = (what, time.monotonic())
        try:
            with self._stuck.guard(what):
                job()
        except Exception:  # nobody awaits the job: its failure is logged, not lost
            log.exception("%s failed", what)
        finally:
            self._running = None


class _Once:
    """A job's `then`, which the loop's callback or close runs, whichever comes first
    (both on the loop's thread)."""

    __slots__ = ("_then", "ran")

    def __init__(self, then: Callable[[], None]) -> None:
        self._then = then
        self.ran = False

    def __call__(self) -> None:
        if not self.ran:
            self.ran = True
            self._then()


def loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
