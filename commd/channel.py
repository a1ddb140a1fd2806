"""Packets with fds over a non-blocking SOCK_SEQPACKET socket on the event loop.

asyncio and uvloop transports cannot carry SCM_RIGHTS, so the channel drives
the raw socket with `add_reader`/`add_writer` (DESIGN §3). Replies that cannot
be sent at once wait in a bounded queue; a client that stops reading until the
queue is full is disconnected rather than allowed to grow the daemon's memory.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .heldfds import Handed, held_closes

log = logging.getLogger("commd.channel")

MAX_FDS = 4
# Besides the packet count (max_queue): what unread replies may hold. A reply is small
# (an Ok is ~20 bytes; a status report up to 64 KiB), and one carrying an fd keeps its
# memory alive (a symmetric allocation): a client that does not read them is dropped
# before they cost the daemon much memory or many fds.
MAX_QUEUED_BYTES = 4 << 20
MAX_QUEUED_FDS = 64
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
# One packet per wakeup: readiness is level-triggered, so a second packet brings another
# wakeup anyway, and reading until EAGAIN costs a failed syscall and an exception per
# packet on the hot path. It also keeps one flooding client from starving the others.
_READS_PER_WAKEUP = 1
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)  # a plain int: IntFlag's & is Python code

PacketHandler = Callable[[bytes, list[int], bool], None]  # data, fds, truncated


def take_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of an SCM_RIGHTS message (the caller owns them)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
    return fds


def close_fds(fds: Sequence[int]) -> None:
    """Close fds, a client's included, without waiting: see _no_linger."""
    for fd in fds:
        _no_linger(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


_NO_LINGER = struct.pack("ii", 0, 0)


def _no_linger(fd: int) -> bool:
    """A socket a client hands over (in place of memory, or beside a bad packet) may be set
    to linger with data that cannot leave; closing its last reference, ours once the client
    closed its copy, would wait for as long as it asks, and the daemon's loop with it.
    Whether `fd` is a socket (its close no longer waits)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket (a memfd, the usual)
        return False
    try:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    finally:
        sock.detach()
    return True


class FdCloser:
    """Closes the fds clients hand over without the loop waiting on them. The close of a
    file whose filesystem has a server (FUSE, NFS) waits for that server (FUSE flushes on
    every close), and a client's own server may never answer: one such fd, sent as
    memory or beside any packet, held the loop and every world with it. Memfds up to
    64 MiB, sockets (unlingered) and pipes close at once, on the loop; larger memfds on a
    thread of their own (see __init__); anything else on `threads` threads of their
    own. A server that never answers holds a thread for good;
    with all of them held, later such fds stay open, in order, until one answers (they
    come only from clients that send what no real client sends)."""

    def __init__(self, threads: int = 4) -> None:
        self._threads = threads
        self._queue: queue.SimpleQueue[Handed | None] = queue.SimpleQueue()
        self._started: list[threading.Thread] = []
        # What the threads have not closed yet: a daemon holding any cannot exit (not even
        # on SIGKILL) until their servers answer, which its stop tells the operator
        self._held: set[Handed] = set()
        self._held_changed = threading.Condition()
        # A large memfd's last close frees its pages (~50 ms a GiB), when the client closed
        # its copy: a refused import of a filled one would stall the loop that long. Such
        # closes take time but end: on a thread of their own, never behind a stuck server's.
        self._freeing = ThreadPoolExecutor(1, thread_name_prefix="commd-fd-free")

    def close(self, fds: Sequence[int]) -> None:
        for fd in fds:
            pages = _memfd_bytes(fd)
            if pages is not None and pages > _FREED_ON_THE_LOOP_BYTES:
                try:
                    self._freeing.submit(_close_quietly, fd)
                    continue
                except RuntimeError:  # stopped: the daemon is ending
                    pass
            if pages is not None or _closes_at_once(fd):
                _close_quietly(fd)
                continue
            if len(self._started) < self._threads:
                thread = threading.Thread(target=self._closing, name=f"commd-fd-close_{len(self._started)}",
                                          daemon=True)  # (one held for good must not hold the exit)
                thread.start()
                self._started.append(thread)
            handed = Handed.of(fd)
            with self._held_changed:
                self._held.add(handed)
            self._queue.put(handed)

    def _closing(self) -> None:
        while (handed := self._queue.get()) is not None:
            _close_quietly(handed.fd)
            with self._held_changed:
                self._held.discard(handed)
                self._held_changed.notify_all()

    def held(self) -> list[Handed]:
        """The fds handed to the threads and not closed yet, oldest first."""
        with self._held_changed:
            return sorted(self._held, key=lambda handed: handed.since)

    def stop(self) -> None:
        """End the threads once what is queued is closed (not waiting for them); say what
        is still held, for it holds the process's exit."""
        for _ in self._started:
            self._queue.put(None)
        self._started.clear()
        self._freeing.shutdown(wait=False)
        # (a file on a disk, handed over a moment ago, is closed in a moment: not worth a word)
        with self._held_changed:
            self._held_changed.wait_for(lambda: not self._held, _CLOSED_BY_THE_STOP_S)
        if held := self.held():
            log.warning("stopping: %s", held_closes(held, time.monotonic()))


def close_theirs(fds: Sequence[int], closer: FdCloser | None) -> None:
    """Close fds a client sent: with `closer`, or (none given) at once."""
    if closer is not None:
        closer.close(fds)
    else:
        close_fds(fds)


_FREED_ON_THE_LOOP_BYTES = 64 << 20
_CLOSED_BY_THE_STOP_S = 0.5


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _memfd_bytes(fd: int) -> int | None:
    """A memfd's size (at most what its last close frees); None for anything else, told
    without asking its filesystem anything (fstat would: FUSE asks its server)."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # (only shmem and hugetlbfs files take seals)
        return os.fstat(fd).st_size
    except OSError:
        return None


def _closes_at_once(fd: int) -> bool:
    """Whether closing `fd`, no memfd, cannot wait (a socket, unlingered; a pipe)."""
    if _no_linger(fd):
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        return True
    except OSError:
        return False


def rights(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []


LINGER_S = 2.0
# What a socket closed at once because too many linger reads of its peer's unread packets
# (a client's send buffer holds a few hundred): a flood of them must not hold the loop.
_MOST_DROPPED = 1024


class Lingering:
    """The sockets closing after a last word (a flush, then linger_close), at most `most`
    at once. Each holds an fd for seconds after its connection stopped counting against
    max_connections: without a bound, a client opening connection after connection
    (refused, or sending garbage) and never closing them took the daemon's fds past any
    limit. Past it a socket closes at once, which loses its last word only to a peer
    writing more at that instant (see _close_unread)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._held: set[socket.socket] = set()

    def hold(self, sock: socket.socket) -> bool:
        if sock in self._held:
            return True
        if len(self._held) >= self.most:
            return False
        self._held.add(sock)
        return True

    def release(self, sock: socket.socket) -> None:
        self._held.discard(sock)


def linger_close(sock: socket.socket, seconds: float = LINGER_S, lingering: Lingering | None = None,
                 closer: FdCloser | None = None) -> None:
    """Close after the peer has read what we sent: shut our side, drain theirs until EOF.

    Closing a Unix socket with unread packets in our queue resets the peer's,
    which would drop the error we just sent it; a refused client must read why.
    """
    if lingering is not None and not lingering.hold(sock):
        sock.setblocking(False)
        _close_unread(sock, _MOST_DROPPED, closer)
        return
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        sock.close()
        if lingering is not None:
            lingering.release(sock)
        return

    def finish() -> None:
        if sock.fileno() != -1:
            loop.remove_reader(fd)
            sock.close()
        if lingering is not None:
            lingering.release(sock)

    def drain() -> None:
        if _drop_unread(sock, closer=closer):
            finish()

    sock.setblocking(False)
    loop.add_reader(fd, drain)
    loop.call_later(seconds, finish)


def _close_unread(sock: socket.socket, most: int = 100_000, closer: FdCloser | None = None) -> None:
    """Close now, without resetting the peer: what it sent and we did not read goes first
    (no loop will run a linger: the daemon is ending, or too many linger). A peer writing
    without end gets no more than `most` packets read."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    _drop_unread(sock, most, closer)
    sock.close()


def _drop_unread(sock: socket.socket, most: int | None = None, closer: FdCloser | None = None) -> bool:
    """Read and drop what waits in non-blocking `sock` (closing the fds it carries, with
    `closer` if any), at most `most` packets; True once the peer closed its side or the
    socket failed."""
    read = 0
    while most is None or read < most:
        try:
            data, ancillary, _, _ = sock.recvmsg(65536, _ANCILLARY)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        read += 1
        close_theirs(take_fds(ancillary), closer)
        if not data and not ancillary:
            return True
    return False


class PacketChannel:
    def __init__(self, sock: socket.socket, limit: int, max_queue: int,
                 on_packet: PacketHandler, on_close: Callable[[str], None],
                 lingering: Lingering | None = None, closer: FdCloser | None = None) -> None:
        self._sock = sock
        self._lingering = lingering
        self.closer = closer  # (for the fds its client sends)
        self._fd = sock.fileno()
        self._limit = limit
        self._max_queue = max_queue
        self._on_packet = on_packet
        self._on_close = on_close
        self._queue: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self._queued_bytes = self._queued_fds = 0
        self._flushing: asyncio.TimerHandle | None = None  # closing: what waits goes first
        self._loop = asyncio.get_running_loop()
        self.closed = False
        sock.setblocking(False)
        # (kept: asked before every op the connection's rank takes part in; only while open,
        # as a closed fd's number may be another socket's)
        self._hang_up = select.poll()
        self._hang_up.register(self._fd, select.POLLRDHUP)
        self._loop.add_reader(self._fd, self._readable)

    def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send one packet; `fds` stay the caller's (queued ones are duplicated)."""
        if self.closed:
            return
        if not self._queue:
            try:
                if fds:
                    self._sock.sendmsg([data], rights(fds))
                else:
                    self._sock.send(data)
                return
            except BlockingIOError:
                self._loop.add_writer(self._fd, self._writable)
            except OSError as exc:
                self.close(f"send failed: {exc}")
                return
        if (len(self._queue) >= self._max_queue or self._queued_bytes + len(data) > MAX_QUEUED_BYTES
                or self._queued_fds + len(fds) > MAX_QUEUED_FDS):
            self._drop(f"client did not read its replies ({len(self._queue)} queued, "
                       f"{self._queued_bytes} bytes, {self._queued_fds} fds)")
            return
        copies: list[int] = []
        try:
            for fd in fds:
                copies.append(os.dup(fd))
        except OSError as exc:  # out of fds: this reply cannot wait
            close_fds(copies)
            self._drop(f"cannot keep a reply's fd until the client reads it: {exc.strerror}")
            return
        self._queue.append((data, copies))
        self._queued_bytes += len(data)
        self._queued_fds += len(copies)

    def _drop(self, why: str) -> None:
        # (the one trace of why its rank's world failed: its client hears nothing)
        log.warning("connection dropped: %s", why)
        self.close(why)

    def _writable(self) -> None:
        while self._queue:
            data, fds = self._queue[0]
            try:
                self._sock.sendmsg([data], rights(fds))
            except BlockingIOError:
                return
            except OSError as exc:
                if self.closed:  # flushing before a linger: the peer went, nothing more to say
                    self._abandon()
                else:
                    self.close(f"send failed: {exc}")
                return
            self._queue.popleft()
            self._queued_bytes -= len(data)
            self._queued_fds -= len(fds)
            close_fds(fds)
        self._loop.remove_writer(self._fd)
        if self.closed and self._flushing is not None:  # all sent: now linger
            self._flushing.cancel()
            self._flushing = None
            linger_close(self._sock, lingering=self._lingering, closer=self.closer)

    def _readable(self) -> None:
        for _ in range(_READS_PER_WAKEUP):
            if self.closed:
                return
            try:
                data, ancillary, flags, _ = self._sock.recvmsg(self._limit + 1, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"receive failed: {exc}")
                return
            fds = take_fds(ancillary) if ancillary else []
            if not data and not fds and self.hung_up():  # (else an empty packet: bad input)
                self.close("peer closed the connection")
                return
            truncated = bool(flags & _TRUNCATED)
            self._on_packet(data, fds, truncated)

    def hung_up(self) -> bool:
        """Whether the peer shut its side (what it sent may still be unread). SOCK_SEQPACKET
        reads an empty packet the same as the end, and one from a peer still connected must
        get its error, not a close."""
        return bool(self._hang_up.poll(0))

    def close(self, reason: str, linger: bool = False, discard_input: bool = False) -> None:
        """Stop; with `linger`, send what waits first (the error that explains the close is
        last in it), for at most LINGER_S, then let the peer read it (see linger_close).
        `discard_input`: the loop is about to end (no linger possible); drop what the peer
        sent and we did not read, so that closing does not reset the peer's socket, which
        would lose what we sent it last (see linger_close)."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        # (a flush holds the socket as a linger does: past the bound, it closes at once)
        if linger and self._queue and (self._lingering is None or self._lingering.hold(self._sock)):
            self._flushing = self._loop.call_later(LINGER_S, self._abandon)  # the writer goes on
        else:
            self._loop.remove_writer(self._fd)
            self._drop_queue()
            if linger:  # (at once, when too many linger)
                linger_close(self._sock, lingering=self._lingering, closer=self.closer)
            elif discard_input:
                _close_unread(self._sock, closer=self.closer)
            else:
                self._sock.close()
        self._on_close(reason)

    def _abandon(self) -> None:
        """A flush before a linger that did not finish: drop what is left and the socket."""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        self._loop.remove_writer(self._fd)
        self._drop_queue()
        self._sock.close()
        if self._lingering is not None:
            self._lingering.release(self._sock)

    def _drop_queue(self) -> None:
        for _, fds in self._queue:
            close_fds(fds)
        self._queue.clear()
        self._queued_bytes = self._queued_fds = 0
