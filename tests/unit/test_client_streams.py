"""StreamOrder with a fake driver: which events close() may destroy while other threads
call (the daemon may hold a pair on its way to it: destroying the exporter's event is
undefined in CUDA while the daemon still records it)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.errors import CommError, CommTimeout, DaemonUnavailable, MisuseError, ProtocolError
from client.streams import StreamOrder

pytestmark = pytest.mark.timeout(30)


def soon() -> float:
    """A call's deadline, a while away."""
    return time.monotonic() + 5.0


class EventDriver:
    """Just what StreamOrder asks of a CUDA driver; remembers which events live."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.destroyed: list[int] = []
        self._ids = iter(range(1, 1 << 30))

    def current_device(self) -> int | None:
        return 0

    def create_ipc_event(self) -> tuple[int, bytes]:
        event = next(self._ids)
        self.live.add(event)
        return event, event.to_bytes(8, "little") * 8

    def destroy_event(self, event: int) -> None:
        self.live.remove(event)
        self.destroyed.append(event)

    def record_event(self, event: int, stream: int) -> None:
        assert event in self.live, f"recorded destroyed event {event}"

    def stream_wait_event(self, stream: int, event: int) -> None:
        assert event in self.live, f"waited on destroyed event {event}"


def test_close_while_a_pair_is_on_its_way_to_the_daemon_keeps_it() -> None:
    """The first call on stream 5 hands its events to the daemon (held here) when close()
    runs on another thread: the pair stays (the daemon may have it); one the daemon never
    had, of another stream, goes (before: close() saw the pair as never sent and
    destroyed both events the daemon was opening)."""
    driver = EventDriver()
    sending, release = threading.Event(), threading.Event()
    handed: list[int] = []

    def send_events(stream: int, ready: bytes, done: bytes, due: float | None) -> int:
        handed.append(stream)
        if stream == 5:
            sending.set()
            assert release.wait(10)
            return 0
        raise MisuseError("refused")  # (the daemon never had stream 6's pair)

    order = StreamOrder(0, send_events, lambda: 0)
    with pytest.raises(MisuseError):
        order.submit(driver, [6], False, soon(), lambda first: None)  # type: ignore[arg-type]
    sent: list[int] = []
    with ThreadPoolExecutor(1) as calling:
        call = calling.submit(order.submit, driver, [5], True, soon(), sent.append)
        assert sending.wait(5)
        order.close(driver)  # type: ignore[arg-type]
        release.set()
        call.result(10)
    assert sent == [5] and handed == [6, 5]
    assert len(driver.destroyed) == 2 and len(driver.live) == 2  # stream 6's went, 5's stayed


def test_no_events_are_made_after_close() -> None:
    driver = EventDriver()
    order = StreamOrder(0, lambda *args: 0, lambda: 0)
    order.close(driver)  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match="closed"):
        order.submit(driver, [3], False, soon(), lambda first: None)  # type: ignore[arg-type]
    assert not driver.live


class HeldDriver(EventDriver):
    """Holds the first record_event / stream_wait_event of stream 5 until `go`."""

    def __init__(self, hold: str) -> None:
        super().__init__()
        self.hold, self.at, self.go = hold, threading.Event(), threading.Event()
        self.armed = False

    def _held(self, what: str) -> None:
        if self.armed and what == self.hold and not self.at.is_set():
            self.at.set()
            assert self.go.wait(10)

    def record_event(self, event: int, stream: int) -> None:
        self._held("record")
        super().record_event(event, stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._held("wait")
        super().stream_wait_event(stream, event)


@pytest.mark.parametrize("hold", ["record", "wait"])
def test_close_after_a_rejoin_keeps_the_pair_a_call_is_using(hold: str) -> None:
    """A call records its ready event (or waits on done) when another thread's rejoin and
    then close() run: the pair stays, during the call and after it, since the daemon
    before the rejoin had it (before: close() destroyed the events under the call)."""
    driver = HeldDriver(hold)
    link = [0]
    order = StreamOrder(0, lambda *args: link[0], lambda: link[0])
    order.submit(driver, [5], True, soon(), lambda first: None)  # type: ignore[arg-type]
    driver.armed = True
    with ThreadPoolExecutor(1) as calling:
        call = calling.submit(order.submit, driver, [5], True, soon(), lambda first: None)
        assert driver.at.wait(5)
        link[0] += 1  # another thread's rejoin
        order.close(driver)  # type: ignore[arg-type]  # and close() on a third
        assert len(driver.live) == 2
        driver.go.set()
        call.result(10)
    assert len(driver.live) == 2


@pytest.mark.parametrize("after_the_rejoin", ["nothing", "a refused hand-over"])
def test_close_after_a_rejoin_keeps_a_pair_the_earlier_daemon_had(after_the_rejoin: str) -> None:
    """A rejoin may find the same daemon process (one that dropped the connection, say),
    which may still record done behind an op of the old connection: the pair it had stays
    at close(), even if the new connection's daemon refused it since (before: a rejoin
    forgot who had it, and close() destroyed both events)."""
    driver = EventDriver()
    link = [0]
    refuse = [False]

    def send_events(stream: int, ready: bytes, done: bytes, due: float | None) -> int:
        if refuse[0]:
            raise MisuseError("refused")
        return link[0]

    order = StreamOrder(0, send_events, lambda: link[0])
    order.submit(driver, [5], True, soon(), lambda first: None)  # type: ignore[arg-type]
    link[0] += 1
    if after_the_rejoin == "a refused hand-over":
        refuse[0] = True
        with pytest.raises(MisuseError):
            order.submit(driver, [5], True, soon(), lambda first: None)  # type: ignore[arg-type]
    order.close(driver)  # type: ignore[arg-type]
    assert driver.destroyed == [] and len(driver.live) == 2


@pytest.mark.parametrize("failure", [DaemonUnavailable("the backend was closed"),
                                     CommTimeout("no reply"), ProtocolError("bad packet from the daemon")],
                         ids=lambda exc: type(exc).__name__)
def test_close_during_a_failing_send_keeps_the_pair(failure: CommError) -> None:
    """close() comes while a stream's events are on their way to the daemon, and that
    request ends without a clear answer (close() broke it, it timed out, the reply was
    garbled; the daemon may have opened the events): the pair stays (before: the call,
    done, destroyed it as never sent)."""
    driver = EventDriver()
    sending, closed = threading.Event(), threading.Event()

    def send_events(stream: int, ready: bytes, done: bytes, due: float | None) -> int:
        sending.set()  # the request is on the wire; the daemon may open the handles
        assert closed.wait(10)
        raise failure

    order = StreamOrder(0, send_events, lambda: 0)
    with ThreadPoolExecutor(1) as calling:
        call = calling.submit(order.submit, driver, [5], True, soon(), lambda first: None)
        assert sending.wait(5)
        order.close(driver)  # type: ignore[arg-type]
        assert len(driver.live) == 2  # close() kept it: on its way to the daemon
        closed.set()
        with pytest.raises(type(failure)):
            call.result(10)
    assert len(driver.live) == 2, f"destroyed {driver.destroyed} the daemon may hold"


def test_a_pair_half_made_leaves_no_event() -> None:
    """The driver makes the ready event and fails the done one: the call fails and no
    event is left (before: ready leaked)."""

    class FailingSecond(EventDriver):
        def create_ipc_event(self) -> tuple[int, bytes]:
            if self.live:
                raise MisuseError("cuEventCreate: out of memory")
            return super().create_ipc_event()

    driver = FailingSecond()
    order = StreamOrder(0, lambda *args: 0, lambda: 0)
    with pytest.raises(MisuseError, match="out of memory"):
        order.submit(driver, [5], False, soon(), lambda first: None)  # type: ignore[arg-type]
    assert not driver.live


def test_a_pair_answered_by_the_daemon_a_rejoin_put_in_place_counts_as_held() -> None:
    """A rejoin replaces the daemon while a stream's events are on their way, and they go
    to the new daemon, which answers: they count as held there, and are not handed over
    again (before: as the daemon had changed meanwhile, they did not count, and close()
    or the call destroyed events the new daemon held)."""
    driver = EventDriver()
    link = [0]
    sending, rejoined = threading.Event(), threading.Event()
    handed: list[int] = []

    def send_events(stream: int, ready: bytes, done: bytes, due: float | None) -> int:
        handed.append(stream)
        sending.set()
        assert rejoined.wait(10)
        return link[0]  # (sent once the new connection was in place: its daemon answered)

    order = StreamOrder(0, send_events, lambda: link[0])
    with ThreadPoolExecutor(1) as calling:
        call = calling.submit(order.submit, driver, [5], True, soon(), lambda first: None)
        assert sending.wait(5)
        link[0] += 1
        rejoined.set()
        call.result(10)
    order.submit(driver, [5], True, soon(), lambda first: None)  # type: ignore[arg-type]
    assert handed == [5]
    order.close(driver)  # type: ignore[arg-type]
    assert len(driver.live) == 2
