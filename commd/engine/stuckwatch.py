"""A watch on the NCCL and CUDA calls that may never return: ncclCommAbort and the frees
(ncclMemFree, cuMemFree, cuMemUnmap, cuIpcCloseMemHandle)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from ..logs import flush_logs

log = logging.getLogger("commd.engine.nccl")

ABORT_LIMIT_S = 60.0  # a normal ncclCommAbort takes well under a second


def _exit_stuck(why: str) -> None:
    log.critical("%s: the daemon's NCCL and CUDA calls cannot go on; exiting, for the service "
                 "manager to start the daemon afresh", why)
    flush_logs()  # (os._exit skips logging's own flush at exit)
    # the thread is inside NCCL or the driver, which no signal or timeout gets it out of,
    # and the daemon's stop waits for it: nothing else ends it
    os._exit(1)


class StuckWatch:
    """ncclCommAbort waits for the device, where another world's kernel or a dead worker's
    event that never fires can hold it for ever; NCCL takes no other call meanwhile, so
    every NCCL world of the daemon would wait with it. A free waits for the device the
    same way, holding the next frees and the daemon's stop (which waits for the frees
    asked). Past `limit_s` this watch's own thread calls `on_stuck` (by default: end
    the process, for its service manager to restart it, the only way out). `stall()`
    tells whoever listens (the peers, through Engine.on_loop_stall) that the event loop
    is about to wait for such a call, so for at most `limit_s`."""

    def __init__(self, limit_s: float = ABORT_LIMIT_S, on_stuck: Callable[[str], None] = _exit_stuck) -> None:
        self._limit = limit_s
        self._on_stuck = on_stuck
        self.announce: Callable[[float], None] | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._current: dict[int, tuple[str, float]] = {}  # guarded calls running now, any thread
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._lock:
            key = next(self._ids)
            self._current[key] = (what, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="commd-stuck-watch", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._current[key]

    def stall(self) -> None:
        if self.announce is not None:
            try:
                self.announce(self._limit)
            except Exception:  # telling the peers is worth a try, not the call
                log.exception("announcing a stall of the loop failed")

    def _watch(self) -> None:
        period = min(1.0, self._limit / 4)
        while True:
            if self._closed.wait(period) and self._current:
                time.sleep(period)  # (closed, calls still guarded: see close)
            now = time.monotonic()
            with self._lock:
                late = [what for what, since in self._current.values() if now - since > self._limit]
                if not late and self._closed.is_set() and not self._current:
                    self._thread = None  # (a call guarded after this starts another)
                    return
            if late:
                self._on_stuck(f"{late[0]} has not returned in {self._limit:g} s")
                return

    def close(self) -> None:
        """The watch ends once no call is guarded, not before: the daemon's stop closes
        the engine before the connections, whose buffers' frees come after (on the
        loop's thread), and one of those that never returned held the stop for ever."""
        self._closed.set()
