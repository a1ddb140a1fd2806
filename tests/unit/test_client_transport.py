"""The client's transport against a daemon that misbehaves: a packet it cannot decode
breaks the connection with a ProtocolError, and the fds that came with it are closed."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import proto
from client.errors import (
    CommError,
    CommTimeout,
    DaemonShutdown,
    DaemonUnavailable,
    LimitExceeded,
    ProtocolError,
)
from client.transport import Transport
from tests.integration.harness import open_fds

# (this process's fds are counted: the collector's work of earlier tests is done first)
pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("collected")]


def fake_daemon(path: str, serve: Callable[[socket.socket], None],
                closed: threading.Event | None = None) -> threading.Thread:
    """A stand-in daemon, listening at `path` once this returns: `serve` gets its first
    connection, on a thread of its own (started, and returned); `closed` is set once that
    connection is closed."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
        with conn:
            serve(conn)
        if closed is not None:
            closed.set()

    server = threading.Thread(target=run)
    server.start()
    return server


def answer_then_stop(conn: socket.socket, answer: str, go: threading.Event | None = None) -> None:
    """Reads a status query, (once `go` is set) answers it with `answer`, then stops as a
    daemon does: the SHUTDOWN event, and (as `serve` returns) the connection closed."""
    first = proto.decode(conn.recv(proto.MAX_MESSAGE_BYTES))
    assert isinstance(first, proto.StatusQuery)
    if go is not None:
        go.wait(10)
    conn.send(proto.encode(proto.StatusReport(first.id, {"answer": answer})))
    conn.send(proto.encode(proto.Event(proto.EventKind.SHUTDOWN, proto.ErrorCode.SHUTDOWN,
                                       "the daemon is shutting down")))


def test_fds_that_came_with_an_undecodable_packet_are_closed() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "bad.sock")

        def bad_daemon(conn: socket.socket) -> None:
            conn.recv(proto.MAX_MESSAGE_BYTES)  # the request
            fd = os.memfd_create("stray")
            try:
                socket.send_fds(conn, [b"\xc1 not msgpack"], [fd])
            finally:
                os.close(fd)
            conn.recv(1)  # until the client hangs up

        server = fake_daemon(path, bad_daemon)
        before = open_fds()
        transport = Transport(path, 5, lambda event, transport: None)
        try:
            with pytest.raises(ProtocolError, match="bad packet"):
                transport.request(proto.StatusQuery(transport.next_id(), None), None)
        finally:
            transport.close()
        server.join(10)
        assert open_fds() == before - 1  # the listener; nothing the bad packet brought stays open


def test_a_failed_send_leaves_another_threads_reply_to_it() -> None:
    """A send that finds the daemon gone reads why it went; a reply that came before, for a
    thread not reading yet, must still reach that thread (its call was done)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "stopping.sock")
        answered = threading.Event()
        server = fake_daemon(path, lambda conn: answer_then_stop(conn, "yours"), answered)
        transport = Transport(path, 5, lambda event, transport: None)
        wait = transport._wait
        may_wait = threading.Event()

        def wait_when_told(request_id: int, deadline: float | None) -> proto.Message:
            may_wait.wait(10)  # (the reply is in the socket by then, read by nobody yet)
            return wait(request_id, deadline)  # type: ignore[return-value]

        transport._wait = wait_when_told  # type: ignore[method-assign]
        replies: list[proto.Message] = []
        first = threading.Thread(target=lambda: replies.append(
            transport.request(proto.StatusQuery(transport.next_id(), None), None)[0]))
        try:
            first.start()
            assert answered.wait(10)
            with pytest.raises(DaemonShutdown, match="shutting down"):
                transport.post(proto.StatusQuery(transport.next_id(), None))
            may_wait.set()
            first.join(10)
        finally:
            may_wait.set()
            transport.close()
            server.join(10)
        assert [r.info for r in replies] == [{"answer": "yours"}]  # type: ignore[attr-defined]


def test_a_failed_send_waits_for_the_reader_to_find_why() -> None:
    """With a thread reading when the daemon refuses the connection and closes, a send that
    fails meanwhile leaves the refusal to that reader and raises what it found: both
    threads see the daemon's reason."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "refusing.sock")
        reader_waits = threading.Event()
        closed = threading.Event()

        def daemon(conn: socket.socket) -> None:
            conn.recv(proto.MAX_MESSAGE_BYTES)
            reader_waits.wait(10)
            conn.send(proto.encode(proto.Error(0, proto.ErrorCode.LIMIT, "too many connections")))

        server = fake_daemon(path, daemon, closed)
        transport = Transport(path, 5, lambda event, transport: None)
        errors: list[Exception] = []

        def call() -> None:
            try:
                transport.request(proto.StatusQuery(transport.next_id(), None), None)
            except Exception as exc:
                errors.append(exc)

        caller = threading.Thread(target=call)
        try:
            caller.start()
            for _ in range(1000):
                if transport._reader is not None:
                    break
                threading.Event().wait(0.01)
            assert transport._reader is not None
            reader_waits.set()
            assert closed.wait(10)
            with pytest.raises(LimitExceeded, match="too many connections"):
                transport.post(proto.StatusQuery(transport.next_id(), None))
            caller.join(10)
        finally:
            reader_waits.set()
            transport.close()
            server.join(10)
        assert [type(e) for e in errors] == [LimitExceeded]
        assert "too many connections" in str(errors[0])


def _wait_for_a_reader(transport: Transport) -> None:
    for _ in range(1000):
        if transport._reader is not None:
            return
        time.sleep(0.01)
    raise AssertionError("no thread started reading")


def test_a_reader_whose_undo_finds_the_daemon_gone_keeps_its_own_reply() -> None:
    """A's request timed out (its undo waits for a late reply). R reads for its own request
    when the daemon sends A's late reply, then R's, and closes: R runs A's undo, whose send
    finds the daemon gone and reads the rest itself, R's reply among them. R's call was
    done: it returns its reply, not the broken connection's error."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "closing.sock")
        got_both, may_answer, closed = threading.Event(), threading.Event(), threading.Event()

        def daemon(conn: socket.socket) -> None:
            first = proto.decode(conn.recv(proto.MAX_MESSAGE_BYTES))
            second = proto.decode(conn.recv(proto.MAX_MESSAGE_BYTES))
            assert isinstance(first, proto.StatusQuery) and isinstance(second, proto.StatusQuery)
            got_both.set()
            may_answer.wait(10)
            conn.send(proto.encode(proto.StatusReport(first.id, {"answer": "A's, late"})))
            conn.send(proto.encode(proto.StatusReport(second.id, {"answer": "R's"})))

        server = fake_daemon(path, daemon, closed)
        transport = Transport(path, 5, lambda event, transport: None)

        def undo(reply: proto.Message, request_id: int) -> proto.Message | None:
            closed.wait(10)  # (slow: the daemon is gone by the time it sends)
            return proto.StatusQuery(request_id, None)

        results: list[object] = []

        def call() -> None:
            try:
                results.append(transport.request(proto.StatusQuery(transport.next_id(), None), None)[0])
            except CommError as exc:
                results.append(exc)

        reader = threading.Thread(target=call)
        try:
            with pytest.raises(CommTimeout):
                transport.request(proto.StatusQuery(transport.next_id(), None),
                                  time.monotonic() + 0.2, undo=undo)
            reader.start()
            assert got_both.wait(10)
            _wait_for_a_reader(transport)
            may_answer.set()
            reader.join(10)
        finally:
            may_answer.set()
            transport.close()
            server.join(10)
        assert [r.info for r in results] == [{"answer": "R's"}]  # type: ignore[attr-defined]


def test_a_failed_send_reads_why_once_the_reader_stops_before_it() -> None:
    """R reads for its reply when the daemon stops (R's reply, the SHUTDOWN event, the close)
    and a send fails on another thread. R takes its reply and stops reading, the event
    unread: the failed send reads it at once and raises DaemonShutdown (not a plain
    DaemonUnavailable after waiting out its wait for a reader)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "stopping.sock")
        go, closed = threading.Event(), threading.Event()
        server = fake_daemon(path, lambda conn: answer_then_stop(conn, "R's", go), closed)
        events: list[proto.Event] = []
        transport = Transport(path, 5, lambda event, transport: events.append(event))
        read_until = transport._read_until
        release = threading.Event()

        def late_reader(request_id: int, deadline: float | None) -> object:
            release.wait(10)  # (woken, but not yet reading: a loaded machine)
            return read_until(request_id, deadline)

        transport._read_until = late_reader  # type: ignore[method-assign,assignment]
        results: list[proto.Message] = []
        reader = threading.Thread(target=lambda: results.append(
            transport.request(proto.StatusQuery(transport.next_id(), None), None)[0]))
        try:
            reader.start()
            _wait_for_a_reader(transport)
            go.set()
            assert closed.wait(10)
            threading.Timer(0.2, release.set).start()
            with pytest.raises(DaemonShutdown):  # (only the event says so: it read it itself)
                transport.post(proto.StatusQuery(transport.next_id(), None))
            reader.join(10)
        finally:
            release.set()
            transport.close()
            server.join(10)
        assert [r.info for r in results] == [{"answer": "R's"}]  # type: ignore[attr-defined]
        assert [e.kind for e in events] == [proto.EventKind.SHUTDOWN]


def test_an_interrupted_request_breaks_the_transport_and_gives_up_its_reading() -> None:
    """Ctrl-C while the main thread, as the reader, waits for a reply: the transport is
    broken (what the daemon did of the request is unknown) and no thread keeps the role."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "silent.sock")
        server = fake_daemon(path, lambda conn: (conn.recv(proto.MAX_MESSAGE_BYTES), conn.recv(1)))
        transport = Transport(path, 5, lambda event, transport: None)
        interrupt = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        try:
            interrupt.start()
            with pytest.raises(KeyboardInterrupt):
                transport.request(proto.StatusQuery(transport.next_id(), None), time.monotonic() + 5)
            assert isinstance(transport.broken, DaemonUnavailable)
            assert "interrupted" in str(transport.broken)
            assert transport._reader is None
        finally:
            interrupt.join()
            transport.close()
        server.join(10)


def test_the_daemons_last_word_is_read_though_it_closed_with_packets_of_ours_unread() -> None:
    """The daemon answers A's request and closes at once, a packet of another thread still
    unread in its socket (as it does after a bug of its own: session.on_packet answers
    INTERNAL and closes; or a daemon killed with replies sent). Linux then gives the
    client's next receive ECONNRESET, once, ahead of what the daemon sent: A gets its
    answer all the same, and the close is seen after it. Before: A's call raised
    DaemonUnavailable "Connection reset by peer" and the daemon's answer was never read."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "bug.sock")
        got, posted, closed = threading.Event(), threading.Event(), threading.Event()

        def daemon(conn: socket.socket) -> None:
            first = proto.decode(conn.recv(proto.MAX_MESSAGE_BYTES))
            assert isinstance(first, proto.StatusQuery)
            got.set()
            posted.wait(10)  # (the other thread's packet is in our socket, never to be read)
            bug = proto.Error(first.id, proto.ErrorCode.INTERNAL, "daemon bug: KeyError(7)")
            conn.send(proto.encode(bug))

        server = fake_daemon(path, daemon, closed)
        transport = Transport(path, 5, lambda event, transport: None)
        wait = transport._wait

        def wait_once_closed(request_id: int, deadline: float | None) -> proto.Message:
            closed.wait(10)  # (the answer and the close are both there when A reads)
            return wait(request_id, deadline)  # type: ignore[return-value]

        transport._wait = wait_once_closed  # type: ignore[method-assign]
        results: list[object] = []

        def call() -> None:
            try:
                results.append(transport.request(proto.StatusQuery(transport.next_id(), None),
                                                 time.monotonic() + 10)[0])
            except CommError as exc:
                results.append(exc)

        caller = threading.Thread(target=call)
        try:
            caller.start()
            assert got.wait(10)
            transport.post(proto.StatusQuery(transport.next_id(), None))
            posted.set()
            caller.join(10)
            answered = [(type(r).__name__, getattr(r, "code", None), getattr(r, "message", str(r)))
                        for r in results]
            assert answered == [("Error", proto.ErrorCode.INTERNAL, "daemon bug: KeyError(7)")]
            transport._wait = wait  # type: ignore[method-assign]
            with pytest.raises(DaemonUnavailable, match="closed the connection"):
                transport.request(proto.StatusQuery(transport.next_id(), None), time.monotonic() + 5)
        finally:
            posted.set()
            closed.wait(10)
            transport.close()
            server.join(10)


def test_a_forget_at_once_as_a_bad_packet_is_read_breaks_the_transport_and_raises_nothing() -> None:
    """A free's Forget goes at once (try_post) just as the reader, on another thread, reads
    a packet it cannot decode, which puts the connection's state machine in ERROR after
    try_post looked at it: nothing goes, the transport is broken (for the next request to
    meet) and the free raises nothing. Before: proto's StateError came out of try_post, so
    out of the buffer's close() (a ProtoError, not a CommError), or was lost in a finalizer."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "bad.sock")
        asked, received = threading.Event(), []

        def bad_daemon(conn: socket.socket) -> None:
            hello = proto.decode(conn.recv(proto.MAX_MESSAGE_BYTES))
            assert isinstance(hello, proto.Hello)
            conn.send(proto.encode(proto.Welcome(hello.id, proto.PROTOCOL_VERSION, "fake", "host", 1,
                                                 proto.MAX_MESSAGE_BYTES)))
            received.append(proto.decode(conn.recv(proto.MAX_MESSAGE_BYTES)))  # the reader's request
            asked.wait(10)  # (until the Forget is on its way)
            conn.send(b"\xc1 not msgpack")
            while packet := conn.recv(proto.MAX_MESSAGE_BYTES):  # until the client hangs up
                received.append(proto.decode(packet))

        server = fake_daemon(path, bad_daemon)
        transport = Transport(path, 5, lambda event, transport: None)
        errors: list[Exception] = []

        def call() -> None:
            try:
                transport.request(proto.StatusQuery(transport.next_id(), None), None)
            except CommError as exc:
                errors.append(exc)

        reader = threading.Thread(target=call)
        try:
            transport.request(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), "w", 0, 1, 5000), None)
            reader.start()
            _wait_for_a_reader(transport)
            machine = transport._conn
            send = machine.send

            def send_once_the_reader_met_the_packet(msg: proto.Message) -> bytes:
                asked.set()
                for _ in range(1000):  # (try_post looked at the state before)
                    if machine.state is proto.State.ERROR:
                        break
                    time.sleep(0.01)
                return send(msg)

            machine.send = send_once_the_reader_met_the_packet  # type: ignore[method-assign]
            assert transport.try_post(proto.Forget((7,))) is False
            reader.join(10)
            assert isinstance(transport.broken, ProtocolError)
            with pytest.raises(ProtocolError):  # (the next request meets it)
                transport.post(proto.Forget((8,)))
        finally:
            asked.set()
            transport.close()
            server.join(10)
        assert [type(e) for e in errors] == [ProtocolError]
        assert [type(m) for m in received] == [proto.StatusQuery]  # (no Forget went)
