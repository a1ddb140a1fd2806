"""The client's blocking side of the socket, shared safely by many threads.

Replies are matched to requests by id. Whichever waiting thread finds no
reader becomes the reader (leader/follower): with one calling thread, a call
is one sendmsg and one recvmsg, with no hand-off to a helper thread, which
would cost a cross-CPU wake-up per call. Pushed events go to `on_event`, with the
transport they came on. The socket's own work (a packet sent or read by a deadline, its
fd closed safely) is PacketSocket's (sockets.py); which replies are due, RepliesDue's.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Callable, Sequence

import proto

from .errors import (
    CommError,
    CommTimeout,
    DaemonUnavailable,
    LimitExceeded,
    ProtocolError,
    detached,
    from_closing,
    from_event,
)
from .replies import RepliesDue
from .sockets import PacketSocket, close_fds, remaining

_PARTING_READS = 64  # after a failed send: unread packets looked through for why the daemon went
_PARTING_WAIT_S = 1.0  # ... or how long the thread reading them has to find that out (deadline allowing)
# A daemon that hung up with no word of why was killed, crashed or restarted: what a worker
# does next is the same for each (a restarted daemon, or its systemd restart, takes it back)
_GONE = " (the daemon stopped, with no word of why); call attempt_reconnect once it is back"

Packet = tuple[proto.Message, list[int]]
# What undoes a request that timed out, should its reply come late: given the reply and a
# fresh request id, the message to send (its own reply is read by nobody), or None.
Undo = Callable[[proto.Message, int], proto.Message | None]
# What a request the daemon may still carry out unanswered leaves the caller to do (see
# Transport.request), given the error the caller is about to hear
Abandon = Callable[[BaseException], None]


class Transport(PacketSocket):
    def __init__(self, path: str, timeout: float,
                 on_event: Callable[[proto.Event, Transport], None],
                 deadline: float | None = None) -> None:
        """Connect to the daemon at `path` by `deadline` (a rejoin's, of which a try may come
        late; None: `timeout` from now); every send then waits at most `timeout`."""
        self._on_event = on_event
        self._conn = proto.Connection(proto.Role.CLIENT)
        self._ids = itertools.count(1)
        # Taken as `with self._lock` (C code, whole): an interrupt cannot land between taking
        # it and the block's exit being armed, as it can in Condition's own __enter__
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._replies: dict[int, Packet] = {}
        self._due = RepliesDue()
        self._awaited: set[int] = set()  # request ids some thread still waits for
        self._undo: dict[int, Undo] = {}  # request id -> what to do with its late reply
        self._fds_lost: set[int] = set()  # awaited request ids whose reply's fd did not fit here
        self._reader: int | None = None  # the thread reading for everyone, if any
        # (under the lock) threads waiting on _cond: a reader that stops with none waiting
        # skips notify_all, four Python calls on every call's path
        self._waiting = 0
        self._broken: CommError | None = None
        # close() came while a thread read: that reader closes the socket when it stops (the
        # fd must not be closed under it, or it may poll whichever socket takes the number)
        self._close_when_read = False
        super().__init__(path, timeout, deadline)
        self._max_send = proto.MAX_MESSAGE_BYTES  # the daemon's, once its welcome says (limit_sends)

    @property
    def state(self) -> proto.State:
        return self._conn.state

    def next_id(self) -> int:
        return next(self._ids)

    def limit_sends(self, max_message: int) -> None:
        """Send no packet over `max_message` bytes, the daemon's limit (its welcome's)."""
        self._max_send = min(max_message, proto.MAX_MESSAGE_BYTES)

    def post(self, msg: proto.Message, fds: Sequence[int] = (), deadline: float | None = None) -> None:
        """Send without waiting for a reply; should the send fail, what the daemon said before
        it went is looked for until `deadline` at the latest (the call's; None: none)."""
        with self._send_lock:
            lost = self._post(msg, fds, deadline)
        if lost is None:
            return
        # (outside the send lock: what is read may be a late reply whose undo sends)
        raise self._read_parting(DaemonUnavailable(f"lost the daemon connection: {lost}{_GONE}"),
                                 deadline) from lost

    def sending(self) -> threading.RLock:
        """Held over sends that must reach the daemon before any other thread's next one, from
        before what they say is decided: the send lock, which every send takes (reentrant)."""
        return self._send_lock

    def try_post(self, msg: proto.Message) -> bool:
        """Send `msg` only if that waits for nothing: no send under way (another thread's, or
        one this thread was in when a finalizer or a signal handler cut in) and room in the
        socket. False if nothing went; a failed send is left for the next request to meet."""
        # Nested in this thread's own send or close (a finalizer, a signal handler): never.
        # Else whether the lock was taken is read back from it: an interrupt lands as the
        # acquire returns (a signal's handler runs after the C call), before any flag set
        # here could say so, and the lock kept would make every other thread's send wait
        # for good (`with` is no help: it would wait). An owner recorded here would not say
        # either: it is written after the acquire returns, where the interrupt lands. So
        # the lock itself is asked (_is_owned: what threading.Condition asks an RLock)
        if self._send_lock._is_owned():  # type: ignore[attr-defined]
            return False
        try:
            if not self._send_lock.acquire(blocking=False):
                return False
            if self._broken is not None or self._conn.state is not proto.State.READY:
                return False
            try:
                self._sock.send(self._packet(msg), socket.MSG_DONTWAIT)
            except (OSError, CommError):  # (no room, or the daemon went; or broken, see _packet)
                return False
            return True
        finally:
            if self._send_lock._is_owned():  # type: ignore[attr-defined]
                self._send_lock.release()

    def _post(self, msg: proto.Message, fds: Sequence[int], deadline: float | None) -> OSError | None:
        """(Under the send lock) post's send: the error if the connection failed."""
        if self._broken is not None:
            raise detached(self._broken)
        packet = self._packet(msg)
        try:
            if self._send(packet, fds, deadline):
                return None
        except OSError as exc:
            return exc
        # the daemon took nothing of this connection's by then: it may never (stopped).
        # Nothing of the packet went, but the Forgets taken for it may have been lost, and
        # the send buffer stays full: the connection goes.
        self._break(DaemonUnavailable(
            f"the daemon took no {type(msg).__name__} from this connection before a "
            "call's deadline, so the connection was dropped; call attempt_reconnect"))
        raise CommTimeout(f"the daemon took no {type(msg).__name__} before the call's "
                          "deadline (it reads nothing), so the connection was dropped: "
                          "call attempt_reconnect")

    def _packet(self, msg: proto.Message) -> bytes:
        """(Under the send lock) `msg` as the state machine lets it go. A ProtocolError if it
        does not: `msg` cannot be encoded, or the reader, reading a bad packet, put it in
        ERROR since the caller looked (another thread's: the send lock does not hold it)."""
        try:
            packet = self._conn.send(msg)
        except (proto.ProtoError, TypeError, ValueError, OverflowError) as exc:
            # the state machine is in ERROR now: break the connection, so that the next
            # attempt_reconnect connects afresh rather than failing on it for good
            raise self._break(ProtocolError(f"cannot send {type(msg).__name__}: {exc}")) from exc
        if len(packet) > self._max_send:  # the daemon would refuse it, and drop the connection
            raise LimitExceeded(f"{type(msg).__name__} is {len(packet)} bytes, over the daemon's "
                                f"{self._max_send} (its max_message): nothing was sent")
        self._due.sent(msg)
        return packet

    def _read_parting(self, lost: CommError, deadline: float | None) -> CommError:
        """A send found the daemon gone: read what it sent before it went, as the reader, so
        that replies reach the threads that wait for them and its parting word (a refusal,
        or a stopping daemon's event) breaks the transport. With another thread reading,
        that thread meets them: wait a little for it to, or to stop reading first, as long as
        the call's `deadline` allows."""
        me = threading.get_ident()
        left = remaining(deadline)
        wait = _PARTING_WAIT_S if left is None else max(0.0, min(_PARTING_WAIT_S, left))
        with self._lock:
            self._undo.clear()  # the daemon drops what the connection did: nothing to undo
            # Another thread reading meets the parting word, unless it stops reading first
            # (its own reply read): then the rest is read here.
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._broken is not None or self._reader in (None, me),
                                    wait)
            finally:
                self._waiting -= 1
            nested = self._reader == me  # (a reader whose undo of a late reply sent this)
            reading = nested or (self._reader is None and self._broken is None)
            if reading:
                self._reader = me
        if reading:
            self._route_last(nested)
        return self._break(lost)

    def _route_last(self, nested: bool = False) -> None:
        """(As the reader, just made one unless `nested`) route what is in the socket, up
        to _PARTING_READS packets, then stop reading."""
        try:
            self._route_waiting(_PARTING_READS)
        finally:
            if not nested:
                self._stop_reading()

    def request(self, msg: proto.Message, deadline: float | None,
                fds: Sequence[int] = (), undo: Undo | None = None,
                abandon: Abandon | None = None) -> Packet:
        """Send `msg` (which carries an id) and wait for its reply until `deadline`.
        `undo`: should the wait time out, what undoes the request if its reply comes late
        (the daemon did it all the same); it runs on whichever thread reads that reply.
        `abandon`: nothing can undo what the daemon would do (a collective that writes the
        worker's memory): should the wait time out, the connection is dropped before the
        CommTimeout is raised, so that the daemon never starts it (see _abandon); and
        whenever it went out (or may have: an interrupt in its send) and ends unanswered
        (that timeout, a lost connection, an interrupt), `abandon(error)` runs before the
        error is raised, for what the daemon may have started already."""
        request_id: int = msg.id  # type: ignore[union-attr]
        left = remaining(deadline)
        if left is not None and left <= 0:  # (sent, the daemon would do it for nobody)
            raise CommTimeout(f"the call's deadline passed before request {request_id} went out")
        with self._lock:
            self._awaited.add(request_id)
        sent = answered = False
        try:
            with _Interruptible(self):
                # (gone, perhaps, once the send is made: an interrupt lands as it returns)
                sent = True
                try:
                    self.post(msg, fds, deadline)
                except CommError:  # (nothing of it went)
                    sent = False
                    raise
                try:
                    packet = self._wait(request_id, deadline)
                except CommTimeout as exc:
                    if abandon is None:
                        raise
                    packet = self._abandon(request_id, exc)
                answered = True
                # Done at the daemon, and of no use here without its fd: undone. (Read without
                # the lock: the reader marks it before it hands the reply on, and a set's `in`
                # is atomic under the GIL)
                if request_id in self._fds_lost:
                    self._late(packet, undo)
                    raise LimitExceeded(
                        f"the daemon's reply to request {request_id} carried a file this process "
                        "had no room for: its open files are at their limit (each host buffer "
                        "holds one): raise it (ulimit -n), or free some")
                return packet
        except BaseException as exc:
            if sent and abandon is not None:
                abandon(exc)
            raise
        finally:
            with self._lock:
                self._awaited.discard(request_id)
                self._fds_lost.discard(request_id)
                late = self._replies.pop(request_id, None)  # came as we gave up: nobody takes it
                if sent and not answered and late is None and undo is not None and self._broken is None:
                    self._undo[request_id] = undo
            if late is not None:
                self._late(late, undo)

    def _abandon(self, request_id: int, timeout: CommTimeout) -> Packet:
        """The caller gives up on request `request_id`, which the daemon may still carry
        out: its reply, if it came meanwhile (then it is done, and nothing comes late);
        else the connection is shut down before the caller hears of the failure, and the
        CommTimeout raised. The daemon checks that a rank is still connected before it
        starts the rank's op, so what the caller hears failed never writes its memory
        later, when the caller may have written, reused or freed it. A reply already in
        the socket with no thread reading is read first: the daemon did the call, and the
        other ranks saw it done."""
        with self._lock:
            reading = self._reader is None and self._broken is None
            if reading:
                self._reader = threading.get_ident()
        if reading:
            self._route_last()
        with self._lock:
            packet = self._replies.pop(request_id, None)
        if packet is not None:
            return packet
        self._break(DaemonUnavailable(
            f"request {request_id} was given up on unanswered (CommTimeout), so this "
            "connection was dropped; call attempt_reconnect"))
        raise CommTimeout(f"{timeout}; the connection was dropped so that the daemon does "
                          "not start the call later: call attempt_reconnect") from timeout

    def _wait(self, request_id: int, deadline: float | None) -> Packet:
        while True:
            with self._lock:
                while True:
                    if request_id in self._replies:
                        return self._replies.pop(request_id)
                    if self._broken is not None:
                        raise detached(self._broken)
                    if self._reader is None:
                        self._reader = threading.get_ident()
                        break
                    left = remaining(deadline)
                    if left is not None and left <= 0:
                        raise CommTimeout(f"no reply to request {request_id} before the deadline")
                    self._waiting += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._waiting -= 1
            try:
                packet = self._read_until(request_id, deadline)
            finally:
                self._stop_reading()
            if packet is not None:
                return packet

    def _read_until(self, request_id: int, deadline: float | None) -> Packet | None:
        """Read as the leader until our reply comes (returned) or another's does (None)."""
        while True:
            try:
                msg, fds = self._read_one(deadline)
            except CommError:
                with self._lock:  # (read by this thread's own parting read, an undo's send failed)
                    if request_id in self._replies:
                        return self._replies.pop(request_id)
                raise
            if getattr(msg, "id", None) == request_id:
                return msg, fds
            if self._route(msg, fds):
                return None

    def _route(self, msg: proto.Message, fds: list[int]) -> bool:
        """Deliver what the reader read that is not its own reply: True if it was another
        waiting thread's reply. Raises the transport's error if the daemon is dropping us."""
        reply_id = getattr(msg, "id", None)
        if isinstance(msg, proto.Event):
            self._on_event(msg, self)
            if msg.kind is proto.EventKind.SHUTDOWN:  # (the daemon closes on us next)
                raise self._break(from_event(msg.kind, msg.code, msg.message))
            return False
        if not reply_id:  # an Error with id 0: the daemon is dropping us
            assert isinstance(msg, proto.Error)
            raise self._break(from_closing(msg.code, msg.message))
        with self._lock:
            if reply_id in self._awaited:
                self._replies[reply_id] = (msg, fds)
                self._cond.notify_all()
                return True
            undo = self._undo.pop(reply_id, None)
        self._late((msg, fds), undo)
        return False

    def _late(self, packet: Packet, undo: Undo | None) -> None:
        """The reply of a call that timed out: nobody reads it; undo what it did."""
        msg, fds = packet
        close_fds(fds)
        remedy = undo(msg, self.next_id()) if undo is not None else None
        if remedy is not None:
            with contextlib.suppress(CommError):  # broken meanwhile: the daemon drops it all anyway
                self.post(remedy)

    def _read_one(self, deadline: float | None) -> Packet:
        if self._broken is not None:  # (closed: the socket is only shut down, never to be polled)
            raise detached(self._broken)
        try:
            data, fds, hung_up, fds_lost = self._receive(deadline)
        except OSError as exc:
            raise self._break(DaemonUnavailable(f"lost the daemon connection: {exc}{_GONE}")) from exc
        if not data and not fds:
            if hung_up:
                raise self._break(DaemonUnavailable(f"the daemon closed the connection{_GONE}"))
            # (a close() on another thread shut the socket since the poll: _break keeps its error)
            raise self._break(ProtocolError("bad packet from the daemon: an empty packet, which "
                                            "holds no message (the daemon is still connected)"))
        # (a lost fd is one at least: the daemon's packets carry at most one, so it was that one)
        nfds = len(fds) + fds_lost
        try:
            msg = self._conn.receive(data, nfds)
        except proto.ProtoError as exc:
            close_fds(fds)  # nobody will take them
            raise self._break(ProtocolError(f"bad packet from the daemon: {exc}")) from exc
        unasked = self._due.unasked(msg, nfds)
        if unasked is not None:
            close_fds(fds)
            raise self._break(ProtocolError(unasked))
        if fds_lost:
            # The reply itself is whole: the connection goes on, and its request fails (see
            # request); one given up on already is undone as its late reply is
            close_fds(fds)
            fds = []
            reply_id = getattr(msg, "id", 0)
            with self._lock:
                if reply_id in self._awaited:
                    self._fds_lost.add(reply_id)
        return msg, fds

    def drain_events(self) -> None:
        """Handle events already waiting in the socket, without blocking."""
        with _Interruptible(self):  # (the role is taken inside: an interrupt right after must not keep it)
            with self._lock:
                if self._reader is not None or self._broken is not None:
                    return
                self._reader = threading.get_ident()
            self._route_waiting()

    def _route_waiting(self, at_most: int | None = None) -> None:
        """(As the reader) route the packets already in the socket, without blocking, until
        none is left (or `at_most` were) or the transport breaks (recorded by _break; it
        surfaces on the next call)."""
        read = 0
        try:
            while (at_most is None or read < at_most) and self._packet_waiting():
                self._route(*self._read_one(None))
                read += 1
        except CommError:
            pass

    def _stop_reading(self) -> None:
        with self._lock:
            self._reader = None
            if self._waiting:
                self._cond.notify_all()
            close = self._close_when_read
        if close:
            self._close_socket()

    @property
    def broken(self) -> CommError | None:
        return self._broken

    def _break(self, error: CommError) -> CommError:
        """Break the transport with `error` unless it broke already; the error it broke with
        (to raise: the one on record never is, see detached)."""
        with self._lock:
            first = self._broken is None
            if self._broken is None:
                self._broken = detached(error)
            broken = detached(self._broken)
            self._cond.notify_all()
        if first:  # the daemon must see us go (a rejoin on a new socket would be "already connected")
            self._shut_down()
        return broken

    def interrupted(self, exc: BaseException) -> CommError:
        """An interrupt (KeyboardInterrupt from Ctrl-C in a notebook, SystemExit: a
        BaseException that is no Exception, raised wherever the thread was) cut a call short
        at an unknown point: a reply read and not handed on, a request sent and not
        recorded, a collective the daemon holds, which would pair with the other ranks' next
        call. Nothing tells what the daemon did of it, so the connection goes (the daemon
        drops what it did for it, and fails the world for every rank); attempt_reconnect
        rejoins afresh. The error the transport broke with. (An Exception is raised where
        the code expects it, and undone there.)"""
        return self._break(DaemonUnavailable(
            f"a call was interrupted ({type(exc).__name__}) midway, so this connection was "
            "dropped; call attempt_reconnect"))

    def close(self, why: CommError | None = None) -> None:
        """Close; the calls still on it, or made on it later, raise `why` (None: the backend
        was closed) unless it broke already."""
        self._break(why or DaemonUnavailable("the backend was closed"))
        self._shut_down()  # (wakes a send blocked in the kernel, and a reader)
        with self._lock:  # (no thread starts reading once broken)
            reading = self._close_when_read = self._reader is not None
        if not reading:
            self._close_socket()

    def close_inherited(self) -> None:
        # (every call in the child is refused: the connection is the parent's)
        self._broken = DaemonUnavailable("the connection belongs to the parent process")
        super().close_inherited()


class _Interruptible:
    """Around a transport's work on the calling thread: an interrupt (a BaseException that
    is no Exception) breaks the transport (see Transport.interrupted), and a reader role
    the thread took within is given up, however the work ended (an interrupt may land
    between taking it and the code that gives it up)."""

    __slots__ = ("_reading", "_thread", "_transport")

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._thread = threading.get_ident()
        self._reading = transport._reader == self._thread  # (then the role is not ours to give up)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: object) -> None:
        try:
            if exc is not None and not isinstance(exc, Exception):
                self._transport.interrupted(exc)
        finally:
            if not self._reading and self._transport._reader == self._thread:
                self._transport._stop_reading()

