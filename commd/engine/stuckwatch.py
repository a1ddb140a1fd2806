"""A watch on the one NCCL call that may never return: ncclCommAbort."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("commd.engine.nccl")

ABORT_LIMIT_S = 60.0  # a normal ncclCommAbort takes well under a second


def _exit_stuck(why: str) -> None:
    log.critical("%s: the daemon's event loop is stuck in it; exiting, for the service manager to "
                 "start the daemon afresh", why)
    os._exit(1)  # the loop's thread is inside NCCL: nothing else can end it


class StuckWatch:
    """ncclCommAbort runs on the event loop's thread (as every NCCL call) and may not
    return: it waits for the device, where another world's kernel or a dead worker's
    event that never fires can hold it. Nothing on the loop can end that; past
    `limit_s` this watch's own thread calls `on_stuck` (by default: end the process,
    for its service manager to restart it, the only way out). So each guarded call
    stalls the loop at most `limit_s`, and `announce(limit_s)` tells whoever listens
    before it may (the peers, through Engine.on_loop_stall)."""

    def __init__(self, limit_s: float = ABORT_LIMIT_S, on_stuck: Callable[[str], None] = _exit_stuck) -> None:
        self._limit = limit_s
        self._on_stuck = on_stuck
        self.announce: Callable[[float], None] | None = None
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        if self.announce is not None:
            try:
                self.announce(self._limit)
            except Exception:  # telling the peers is worth a try, not the abort
                log.exception("announcing a stall of the loop failed")
        with self._lock:
            self._current = (what, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="commd-abort-watch", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self._limit / 4)):
            with self._lock:
                current = self._current
            if current is not None and time.monotonic() - current[1] > self._limit:
                self._on_stuck(f"{current[0]} has not returned in {self._limit:g} s")
                return

    def close(self) -> None:
        self._closed.set()
