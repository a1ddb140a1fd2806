"""What the transport needs of Unix sockets beyond the socket module: the socket to the
daemon, sending and receiving whole packets by a deadline (PacketSocket), and the
helpers it takes fds and connects with."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence

import proto

from .errors import CommTimeout, DaemonUnavailable

_MAX_FDS = 4
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * 4)
_MAX_POLL_MS = 2**31 - 1  # poll() takes a C int of milliseconds (~24.8 days; a timeout may be a year)
# As plain ints: `int & socket.MSG_CTRUNC` (an IntFlag) builds a flag member through enum's
# Python code, three calls on every packet read
_HUNG_UP = select.POLLHUP | select.POLLRDHUP
_CTRUNC = int(socket.MSG_CTRUNC)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until `deadline` (monotonic), None for no deadline."""
    return None if deadline is None else deadline - time.monotonic()


def take_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of a message's SCM_RIGHTS ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    return fds


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def connect_within(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect within `timeout`; a full listen backlog (EAGAIN on Unix sockets) is retried."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def timeval(seconds: float) -> bytes:
    seconds = max(seconds, 1e-6)  # (a zero timeval is no timeout at all: a wait for good)
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


class PacketSocket:
    """The client's end of the daemon's SOCK_SEQPACKET socket, used by many threads: one
    packet (whole, with its fds) sent or received at a time, each by a deadline. What the
    packets say, and which thread sends or reads them when, is the Transport's (its
    subclass). The fd is not closed while a send of this thread may still poll it by its
    number, which another socket or pipe may take once closed (see _close_socket; a
    reader's poll is the Transport's to wait for); a forked child closes its copy at once
    (see _in_forked_child)."""

    def __init__(self, path: str, timeout: float, deadline: float | None) -> None:
        """Connect to the daemon at `path` by `deadline` (a rejoin's, of which a try may come
        late; None: `timeout` from now); every send then waits at most `timeout`."""
        # Reentrant: a signal handler runs on the thread it interrupts, which may be inside
        # a send, and may close() the backend (a SIGTERM handler); a plain lock waited for
        # itself for good. The send it cut into then finds the socket closed (its fd -1, not
        # a number another socket took) and raises
        self._send_lock = threading.RLock()
        # (under the send lock) a send is under way, which may wait in poll() by the socket's
        # fd number; a close() meanwhile is on the same thread (a signal handler: the lock is
        # reentrant), and the send closes the socket once it stops (see _close_socket)
        self._sending = self._close_when_sent = False
        with _MAKING:  # (a fork waits: the child must know of every socket it has a copy of)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._sock = sock
            _OPEN.add(self)
        try:
            # A kernel timeout instead of Python's: a connect waiting in a full listen
            # backlog ends by the deadline, or after `timeout` if that comes first.
            # Receives wait in poll() with the call's deadline, and then read what is there;
            # the short receive timeout only bounds a read that finds nothing after all.
            # Sends never block in the kernel: one the daemon does not take (it stopped
            # reading) waits in poll() by the call's deadline (see _send).
            connecting = timeout if deadline is None else min(timeout, deadline - time.monotonic())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(connecting))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(min(0.25, timeout / 4)))
            connect_within(sock, path, connecting)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to the daemon at {path}: {exc}") from exc
        self._timeout = timeout
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
        self._send_poll = select.poll()
        self._send_poll.register(sock.fileno(), select.POLLOUT)

    def _send(self, packet: bytes, fds: Sequence[int], deadline: float | None) -> bool:
        """(Under the send lock) Send one packet (whole, or nothing of it: SOCK_SEQPACKET)
        once the daemon has room for it, by `deadline` (None: within the backend's
        timeout, as every blocking call is). False if the deadline came first; an OSError
        if the timeout did, or the connection failed."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
        limit = time.monotonic() + self._timeout
        if deadline is not None and deadline < limit:
            limit = deadline
        self._sending = True
        try:
            while True:
                try:
                    if ancillary:
                        self._sock.sendmsg([packet], ancillary, socket.MSG_DONTWAIT)
                    else:
                        self._sock.send(packet, socket.MSG_DONTWAIT)
                    return True
                except BlockingIOError:
                    pass
                left = limit - time.monotonic()
                if left <= 0:
                    if limit == deadline:
                        return False
                    raise TimeoutError(f"the daemon took nothing within {self._timeout:g}s")
                # (a close() from a signal handler on this thread shuts the socket and leaves
                # it open: poll wakes, and the send meets the shut socket)
                self._send_poll.poll(min(max(1, int(left * 1000)), _MAX_POLL_MS))
        finally:
            self._sending = False
            if self._close_when_sent:
                self._sock.close()

    def _receive(self, deadline: float | None) -> tuple[bytes, list[int], bool, bool]:
        """(As the one reader) Wait for a packet until `deadline` (None: for good; a
        CommTimeout once it passed), and read it: its bytes, its fds, whether the daemon
        had hung up (no bytes and no fds are then the end of the connection, else an empty
        packet), and whether fds it carried were lost (the kernel drops those this process
        has no room for, at its open-file limit, and says only that). An OSError if the
        connection failed."""
        while True:  # (a deadline further than poll() can wait is waited for in steps)
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise CommTimeout("the call did not complete before its deadline")
            ready = self._poll.poll(None if left is None else min(max(1, int(left * 1000)), _MAX_POLL_MS))
            if ready:
                break
        # recvmsg reads no bytes both at the end of the connection and for a zero-length
        # packet (legal on SOCK_SEQPACKET); only the hang-up poll saw before the read tells
        # them apart (without it, the packet the read takes was already there)
        hung_up = bool(ready[0][1] & _HUNG_UP)
        try:
            data, ancillary, flags, _ = self._sock.recvmsg(proto.MAX_MESSAGE_BYTES + 1, _ANCILLARY)
        except ConnectionResetError:
            # The daemon closed with packets of ours unread (killed, or a bug's INTERNAL
            # answer): Linux says so once, ahead of what it sent before, its answers and
            # last word among them. Those come next, then the end
            hung_up = True
            data, ancillary, flags, _ = self._sock.recvmsg(proto.MAX_MESSAGE_BYTES + 1, _ANCILLARY)
        return data, take_fds(ancillary) if ancillary else [], hung_up, bool(flags & _CTRUNC)

    def _packet_waiting(self) -> bool:
        """Whether a packet (or the end of the connection) is there to read now."""
        return bool(self._poll.poll(0))

    def _shut_down(self) -> None:
        """Shut the connection down both ways, leaving the fd open (see _close_socket)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _close_socket(self) -> None:
        """Close the socket now, or once this thread's send stops if it is inside one."""
        # (a sender past its check that the transport is open must not meet a closed socket)
        with self._send_lock:
            if self._sending:  # (this thread's, cut into by a signal handler) poll() would retry
                # by the fd number, which another socket or pipe may take once closed
                self._close_when_sent = True
                return
            self._sock.close()

    def close_inherited(self) -> None:
        """In a forked child: close this process's copy of the socket, leaving the connection
        (the parent's) as it is: no shutdown, which would end the parent's connection too,
        and no lock, which a thread the child lacks may have held."""
        self._sock.close()


# Every packet socket of this process, which may be open (see _in_forked_child), and the
# lock a fork waits for while a socket is made and not yet among them.
_OPEN: weakref.WeakSet[PacketSocket] = weakref.WeakSet()
_MAKING = threading.Lock()


def _in_forked_child() -> None:
    """A fork copies every socket into the child. A copy held open keeps the parent's
    connection alive after the parent dies (its daemon would not see the rank go), so the
    child closes its copies at once: one under way (connecting, saying hello) too."""
    _MAKING.release()
    for packets in list(_OPEN):
        packets.close_inherited()


os.register_at_fork(before=_MAKING.acquire, after_in_parent=_MAKING.release,
                    after_in_child=_in_forked_child)
