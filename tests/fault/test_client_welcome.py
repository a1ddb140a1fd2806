"""The world a rank joins may fail before its welcome arrives: the daemon sends the welcomes
in rank order once every waiter is a member, and a lower rank's welcome that finds its peer
gone fails the world, so a higher rank hears WORLD_FAILED (about the new epoch) before its
own welcome. (A review reproduced that order against a real daemon, holding it with SIGSTOP
so that one rank's hello and another's close were read in one loop turn; the order the loop
reads them in is not fixed, so here the event is delivered, as read before the welcome, by
the hello's own connection.)"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

import proto
from client import CommError, DaemonBackend, hostmem
from client import connection as client_connection
from client.transport import Abandon, Packet, Transport, Undo
from commd.launch import DaemonProcess
from tests.fault.ranks import own_daemon
from tests.integration.harness import world_name

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


class FailedBeforeWelcome(Transport):
    """A connection on which the world fails before the hello is answered."""

    def request(self, msg: proto.Message, deadline: float | None, fds: Sequence[int] = (),
                undo: Undo | None = None, abandon: Abandon | None = None) -> Packet:
        if isinstance(msg, proto.Hello):  # the 1-rank world forms at the epoch after the hello's
            self._route(proto.Event(proto.EventKind.WORLD_FAILED, proto.ErrorCode.PEER_LOST,
                                    "a rank's welcome found it gone", msg.epoch + 1), [])
        return super().request(msg, deadline, fds, undo, abandon)


def test_constructor_hears_the_failure_before_its_welcome(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructor returns a backend that is not healthy (before: AttributeError, the
    event came before the backend had a connection)."""
    monkeypatch.setattr(client_connection, "Transport", FailedBeforeWelcome)
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5) as comm:
        assert not comm.is_healthy()
        monkeypatch.undo()
        comm.attempt_reconnect()
        assert comm.is_healthy()


def test_rejoin_hears_the_failure_before_its_welcome(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same after a daemon restart: the rejoined world failed before the welcome, and
    is_healthy() says so (before: the event, on the rejoin's connection, not yet the
    backend's, was dropped, and the failed world read healthy)."""
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5) as comm:
        buf = hostmem.alloc(8)
        daemon.kill()
        daemon.start()
        with pytest.raises(CommError):
            comm.all_reduce(buf.ptr, 8, dtype="i32")
        monkeypatch.setattr(client_connection, "Transport", FailedBeforeWelcome)
        comm.attempt_reconnect()
        assert not comm.is_healthy()
        monkeypatch.undo()
        comm.attempt_reconnect()
        buf.view("i4")[:2] = [4, 5]
        comm.all_reduce(buf.ptr, 8, dtype="i32")
        assert comm.is_healthy() and buf.view("i4")[:2].tolist() == [4, 5]
