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
from collections.abc import Callable, Sequence

from .cuda import CudaDriver
from .errors import CommTimeout, DaemonUnavailable, MisuseError


class StreamOrder:
    def __init__(self, device: int | None, timeout: float,
                 send_events: Callable[[int, bytes, bytes], int], link: Callable[[], int]) -> None:
        self._device = device  # the backend's GPU: the one whose context the events belong to
        self._timeout = timeout
        # (stream, ready's handle, done's handle) to the daemon; the daemon connection that answered
        self._send_events = send_events
        self._link = link  # the current daemon connection (DaemonBackend._link)
        self._lock = threading.Lock()
        self._events: dict[int, tuple[int, int, bytes, bytes]] = {}  # stream -> ready, done, handles
        self._sent: set[int] = set()  # streams whose events this connection's daemon holds
        self._sending: set[int] = set()  # streams whose events are on their way (it may hold them)
        self._unanswered: set[int] = set()  # streams whose events went without an answer (it may too)
        self._in_use: set[int] = set()  # streams whose events a call records or waits on now
        self._closed = False
        self._turns: dict[int, threading.Lock] = {}  # a stream's events serve one call at a time

    def submit(self, driver: CudaDriver, streams: Sequence[int], early: bool, deadline: bool,
               send: Callable[[int], None]) -> None:
        """`send(first)` makes the request that follows `streams[0]` and returns with its
        reply (the other streams were waited for on the host). Answered once ordered
        (`early`), every stream then waits for the ops on the device: a group's receive
        may land on another stream than its send."""
        self._check_current_device(driver)
        first = streams[0]
        with self._lock:
            turn = self._turns.setdefault(first, threading.Lock())
        # held until the daemon ordered the call; one without a deadline (recv_command_u32)
        # may hold it long, and the others keep their own
        if not turn.acquire(timeout=self._timeout if deadline else -1):
            raise CommTimeout(f"another call of this process on stream {first} held its events "
                              f"for {self._timeout:g}s (a recv_command_u32 waiting on it?)")
        try:
            ready, done = self._events_for(first, driver)
            driver.record_event(ready, first)
            send(first)
            if early:
                for stream in streams:
                    driver.stream_wait_event(stream, done)
        finally:
            self._done_with(first, driver)
            turn.release()

    def new_daemon(self) -> None:
        """(As the link moves) A restarted daemon holds none of our events: each goes again
        with its next call."""
        with self._lock:
            self._sent.clear()

    def close(self, driver: CudaDriver | None) -> None:
        """Destroy the events the daemon never had. Those it has stay until the process
        exits: it may still record `done` behind an op answered early, and destroys its
        copies only once that op is done, while CUDA leaves anything done with an opened
        event after its exporter destroyed it undefined (a daemon gone since holds none)."""
        with self._lock:
            self._closed = True
            events = self._events
            # a pair a call uses now stays for it: the call destroys it as it ends (_done_with)
            self._events = {s: pair for s, pair in events.items() if s in self._in_use}
            keep = self._sent | self._sending | self._unanswered | self._in_use
        if driver is not None:
            for stream, (ready, done, _, _) in events.items():
                if stream not in keep:
                    driver.destroy_event(ready)
                    driver.destroy_event(done)

    def _done_with(self, stream: int, driver: CudaDriver) -> None:
        """A call is done with the stream's events: if close() came meanwhile and the daemon
        holds none of them, they are destroyed now."""
        with self._lock:
            self._in_use.discard(stream)
            held = stream in self._sent or stream in self._sending or stream in self._unanswered
            pair = self._events.pop(stream, None) if self._closed and not held else None
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

    def _events_for(self, stream: int, driver: CudaDriver) -> tuple[int, int]:
        """The stream's (ready, done), created once; handed to the daemon when it lacks them.
        (Under the lock with close(): it must not destroy events the daemon may hold, nor
        may events be made after it, which nothing would destroy.)"""
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
            sent = stream in self._sent
            if not sent:
                self._sending.add(stream)
            self._in_use.add(stream)
        if not sent:
            try:
                answered_on = self._send_events(stream, pair[2], pair[3])
            except (DaemonUnavailable, CommTimeout):  # no answer: the daemon may have opened them
                with self._lock:
                    self._unanswered.add(stream)
                raise
            else:
                with self._lock:
                    if answered_on == self._link():  # (else that daemon is gone: sent again)
                        self._sent.add(stream)
            finally:
                with self._lock:
                    self._sending.discard(stream)
        return pair[0], pair[1]
