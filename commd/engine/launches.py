"""Launches half made, and the CUDA calls that must not start inside one.

A non-blocking ncclGroupEnd leaves NCCL's own thread to enqueue the group's kernels, one
GPU after the other, until each communicator reads ncclSuccess again. A CUDA call that
may wait for a whole device (freeing or unmapping memory, loading a module, NCCL's
deregistration) must not start meanwhile: it would wait for a kernel already running,
which waits for its peers' kernels, whose launch may wait for the lock that call holds
(NVIDIA's answer in PyTorch issue 50925). Such calls wait for the launches; launches
never wait for them.

Between launches such a call waits only for kernels whose peers were launched with
them (a daemon launches the local sides of a collective, or of a send and its receive,
in one group) or run on other daemons. Not covered: a kernel waiting for another
daemon's launch keeps such a call waiting (and, by the same lock, this daemon's next
launches) until that daemon launches; holding launches back for frees instead could
only hang where the driver would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class Launches:
    """Begun and ended on the event loop; waited for on the threads that make the calls
    (the loop itself awaits `idle`). One per engine, as a launch on one GPU may wait for
    another's: a launch that stays in progress (a send waiting for its receiver to
    launch) holds every world's frees meanwhile; they are late, never lost."""

    def __init__(self) -> None:
        self._cv = threading.Condition()  # (a mapping may be let go of off the loop)
        self._open = 0
        self._closed = False
        self._after: list[Callable[[], None]] = []

    def begin(self) -> None:
        with self._cv:
            self._open += 1

    def end(self) -> None:
        with self._cv:
            self._open -= 1
            if self._open > 0:
                return
        self._release_all()  # (launches begin on this thread: none began since)

    def quiet(self) -> bool:
        """No launch is half made now (or the engine is closing)."""
        with self._cv:
            return self._open == 0 or self._closed

    @contextlib.contextmanager
    def between(self) -> Iterator[None]:
        """Block this thread (never the loop's) until no launch is half made, then run
        the body."""
        with self._cv:
            self._cv.wait_for(lambda: self._open == 0 or self._closed)
        yield

    async def idle(self) -> None:
        """On the loop: until no launch is half made. Calls made next, with no await
        between, run before any other launch begins (launches begin on the loop)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not waiter.done():  # (cancelled meanwhile)
                waiter.set_result(None)

        self.after(wake)
        await waiter

    def after(self, job: Callable[[], None]) -> None:
        """`job` now if no launch is half made, else once none is (on the loop)."""
        with self._cv:
            if self._open > 0 and not self._closed:
                self._after.append(job)
                return
        job()

    def close(self) -> None:
        """The engine is closing: nothing waits for a launch any more (one stuck in
        progress would otherwise keep its frees for ever)."""
        with self._cv:
            self._closed = True
        self._release_all()

    def _release_all(self) -> None:
        """Wake the threads waiting for the launches (with none open, or closing), then
        run each held job, whatever the ones before it did."""
        with self._cv:
            self._cv.notify_all()
            after, self._after = self._after, []
        for job in after:
            try:
                job()
            except Exception:  # a failure is logged, not lost
                log.exception("a call held back for a launch failed")
