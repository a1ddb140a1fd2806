"""How a worker's calls on device memory follow its CUDA streams (DESIGN §5), with an
engine that has streams of its own (NCCL).

Per stream of the worker, two interprocess events: `ready`, recorded on the stream
before the request goes (the daemon's stream waits for it), and `done`, which the
daemon records behind the op (the worker's streams wait for it when the call is
answered once ordered). Each pair is handed to the daemon once per connection and
serves one call at a time, until the daemon has ordered it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from .cuda import CudaDriver
from .errors import CommError, CommTimeout, LimitExceeded, MisuseError


class StreamOrder:
    """A pair a daemon had, or may have had (its hand-over got no clear refusal), is never
    destroyed here: that daemon (an earlier one too: a rejoin may find the same daemon
    process) may still record `done` behind an op answered early, and destroys its copies
    only once that op is done, while CUDA leaves anything done with an opened event after
    its exporter destroyed it undefined. Such pairs stay until the process exits; the
    others go at close()."""

    def __init__(self, device: int | None,
                 send_events: Callable[[int, bytes, bytes, float | None], int],
                 link: Callable[[], int]) -> None:
        self._device = device  # the backend's GPU: the one whose context the events belong to
        # (stream, ready's handle, done's handle, the call's deadline) to the daemon; the
        # daemon connection that answered
        self._send_events = send_events
        self._link = link  # the current daemon connection (Connection.link)
        # Reentrant: close() may come from a signal handler (a SIGTERM handler's
        # DaemonBackend.close), which runs on the thread it interrupts, perhaps under this
        # very lock: a plain one waited for itself for good. The bookkeeping it cuts into
        # stays sound: close() is the only loop over the tables and never cuts into itself
        # (the backend runs it once); a pair it destroys before the call it cut into marked
        # it in use never reaches the driver or the daemon (that call's next request finds
        # the backend closed), and one made after it goes at _done_with.
        self._lock = threading.RLock()
        self._events: dict[int, tuple[int, int, bytes, bytes]] = {}  # stream -> ready, done, handles
        self._held_on: dict[int, int] = {}  # stream -> the connection whose daemon took its pair
        self._exposed: set[int] = set()  # streams whose pair a daemon has or may have: kept
        self._in_use: set[int] = set()  # streams whose pair a call hands over, records or waits on
        self._closed = False
        self._turns: dict[int, threading.Lock] = {}  # a stream's events serve one call at a time

    def submit(self, driver: CudaDriver, streams: Sequence[int], early: bool, due: float | None,
               send: Callable[[int], None]) -> None:
        """`send(first)` makes the request that follows `streams[0]` and returns with its
        reply (the other streams were waited for on the host). Answered once ordered
        (`early`), every stream then waits for the ops on the device: a group's receive
        may land on another stream than its send. `due`: the call's deadline (None: none)."""
        self._check_current_device(driver)
        first = streams[0]
        with self._lock:
            turn = self._turns.setdefault(first, threading.Lock())
        # held until the daemon ordered the call; one without a deadline (recv_command_u32)
        # may hold it long, and the others keep their own
        taken = False
        try:  # (taken inside: an interrupt right after the acquire must not keep it)
            taken = turn.acquire(timeout=-1 if due is None else max(0.0, due - time.monotonic()))
            if not taken:
                raise CommTimeout(f"another call of this process on stream {first} held its events "
                                  "past this call's deadline (a recv_command_u32 waiting on it?)")
            ready, done = self._events_for(first, driver, due)
            driver.record_event(ready, first)
            try:
                send(first)
            except CommError:
                # A group fails whole, yet an op of it may be on the device already, ordered
                # and its `done` recorded, when another of it failed (the world failed under
                # it): the worker, told the group failed, takes the buffers back on these
                # streams. A `done` the daemon did not record for this call is one already
                # passed, and the wait costs nothing.
                if early:
                    self._wait_done(driver, streams, done)
                raise
            if early:
                self._wait_done(driver, streams, done)
        finally:
            if taken:
                self._done_with(first, driver)
                turn.release()

    @staticmethod
    def _wait_done(driver: CudaDriver, streams: Sequence[int], done: int) -> None:
        for stream in streams:
            driver.stream_wait_event(stream, done)

    def close(self, driver: CudaDriver | None) -> None:
        """Destroy the pairs no daemon had; one a call uses now goes when it is done with it."""
        with self._lock:
            self._closed = True
            events = self._events
            self._events = {s: pair for s, pair in events.items() if s in self._in_use}
            keep = self._exposed | self._in_use
        if driver is not None:
            for stream, (ready, done, _, _) in events.items():
                if stream not in keep:
                    driver.destroy_event(ready)
                    driver.destroy_event(done)

    def _done_with(self, stream: int, driver: CudaDriver) -> None:
        with self._lock:
            self._in_use.discard(stream)
            closing = self._closed and stream not in self._exposed
            pair = self._events.pop(stream, None) if closing else None
        if pair is not None:
            driver.destroy_event(pair[0])
            driver.destroy_event(pair[1])

    def _check_current_device(self, driver: CudaDriver) -> None:
        """The events are created, and stream 0 is, in the thread's current context: another
        device's would order the call after the wrong GPU's work (or fail)."""
        if self._device is None:
            return
        current = driver.current_device()
        if current != self._device:
            now = "no CUDA context is current" if current is None else f"CUDA device {current} is current"
            raise MisuseError(f"{now} in this thread, but this backend serves device {self._device}: "
                              f"make it current first (torch.cuda.set_device({self._device}))")

    def _events_for(self, stream: int, driver: CudaDriver, due: float | None) -> tuple[int, int]:
        """The stream's (ready, done), created once; handed to the daemon of the current
        connection when it lacks them. (Under the lock close() takes: no pair is made after
        it, which nothing would destroy.)"""
        with self._lock:
            if self._closed:
                raise MisuseError("the backend is closed")
            pair = self._events.get(stream)
            if pair is None:
                ready, ready_handle = driver.create_ipc_event()
                try:
                    done, done_handle = driver.create_ipc_event()
                except BaseException:
                    driver.destroy_event(ready)
                    raise
                pair = self._events[stream] = (ready, done, ready_handle, done_handle)
            handed = self._held_on.get(stream) == self._link()
            self._in_use.add(stream)
        if not handed:
            try:
                answered_on = self._send_events(stream, pair[2], pair[3], due)
            except (MisuseError, LimitExceeded):  # refused (or never sent): no daemon has them
                # (a CommTimeout may also mean never sent: kept all the same, which is safe)
                raise
            except BaseException:  # no answer, or no clear one: the daemon may have opened them
                with self._lock:
                    self._exposed.add(stream)
                raise
            with self._lock:  # (answered on a connection a rejoin replaced: again next call)
                self._held_on[stream] = answered_on
                self._exposed.add(stream)
        return pair[0], pair[1]
