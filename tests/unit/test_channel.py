"""The daemon's packet channel (commd/channel.py) against a peer that does not read: its
unread replies are bounded in packets, bytes and fds, and it is dropped past any of them
with every queued fd closed."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from commd.channel import MAX_QUEUED_BYTES, MAX_QUEUED_FDS, FdCloser, PacketChannel
from tests.integration.harness import open_fds

pytestmark = pytest.mark.timeout(30)


def channel_to_a_peer_that_never_reads(max_queue: int = 100_000
                                       ) -> tuple[PacketChannel, socket.socket, list[str]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    closed: list[str] = []
    channel = PacketChannel(ours, 65536, max_queue, lambda data, fds, truncated: None, closed.append)
    return channel, theirs, closed


async def test_replies_holding_fds_drop_the_client_past_the_fd_limit() -> None:
    before = open_fds()
    channel, theirs, closed = channel_to_a_peer_that_never_reads()
    memfd = os.memfd_create("reply")
    try:
        for _ in range(10_000):
            channel.send(b"a reply with its memory", [memfd])
            if closed:
                break
        assert closed and "fds" in closed[0], closed
        assert closed[0].endswith(f"{MAX_QUEUED_FDS} fds)")  # it held no more than the limit
    finally:
        os.close(memfd)
        theirs.close()
    await asyncio.sleep(0)
    assert open_fds() <= before  # what the kernel and the queue held is gone with the sockets


async def test_large_unread_replies_drop_the_client_past_the_byte_limit(
        caplog: pytest.LogCaptureFixture) -> None:
    channel, theirs, closed = channel_to_a_peer_that_never_reads()
    try:
        sent = 0
        while not closed and sent < 4 * MAX_QUEUED_BYTES:
            channel.send(b"s" * 60_000)
            sent += 60_000
        assert closed and "bytes" in closed[0], closed
        queued = int(closed[0].split(", ")[1].split()[0])
        assert MAX_QUEUED_BYTES - 60_000 < queued <= MAX_QUEUED_BYTES
        # the operator's one trace of it (it was at DEBUG: the world's failure said only "lost")
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"connection dropped: {closed[0]}"]
    finally:
        theirs.close()


async def test_a_peer_that_reads_gets_every_reply_in_order() -> None:
    channel, theirs, closed = channel_to_a_peer_that_never_reads()
    theirs.setblocking(False)
    got: list[bytes] = []
    for i in range(2000):  # more than the socket buffer holds: some wait in the queue
        channel.send(i.to_bytes(4, "little") * 64)
    while len(got) < 2000:
        try:
            got.append(theirs.recv(65536))
        except BlockingIOError:
            await asyncio.sleep(0.001)  # the loop sends what waited
    assert not closed and [int.from_bytes(g[:4], "little") for g in got] == list(range(2000))
    channel.close("test over")
    theirs.close()


async def test_closing_with_linger_sends_what_waits_and_the_error_last() -> None:
    """A client whose replies are backed up sends garbage: the daemon closes it with an
    error, which must reach it after the replies it has yet to read, not be dropped."""
    channel, theirs, closed = channel_to_a_peer_that_never_reads()
    for i in range(2000):  # more than the socket buffer holds
        channel.send(i.to_bytes(4, "little") * 64)
    channel.send(b"error: bad message")
    channel.close("bad message", linger=True)
    theirs.setblocking(False)
    got: list[bytes] = []
    while True:
        try:
            packet = theirs.recv(65536)
        except BlockingIOError:
            await asyncio.sleep(0.001)
            continue
        if not packet:
            break  # the daemon's side shut down after the last one
        got.append(packet)
    theirs.close()
    assert closed == ["bad message"]
    assert len(got) == 2001 and got[-1] == b"error: bad message"
    assert [int.from_bytes(g[:4], "little") for g in got[:-1]] == list(range(2000))


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_a_large_memfd_a_client_sent_is_closed_off_the_loop() -> None:
    """Its last close frees its pages (~50 ms a GiB): a refused import of a filled 20 GiB
    memfd, its client's copy closed, held the loop a second. Small memfds, sockets and
    pipes still close at once; the large one on the closer's own thread (held here)."""
    closer = FdCloser()
    held = threading.Event()
    try:
        closer._freeing.submit(held.wait, 10)
        large, small = os.memfd_create("large"), os.memfd_create("small")
        os.ftruncate(large, 1 << 30)  # (its size is what counts: sparse is enough here)
        os.ftruncate(small, 4096)
        read_end, write_end = os.pipe()
        closer.close([large, small, read_end, write_end])
        assert [is_open(fd) for fd in (large, small, read_end, write_end)] == [True, False, False, False]
        held.set()
        deadline = time.monotonic() + 10
        while is_open(large):
            assert time.monotonic() < deadline, "the large memfd was never closed"
            time.sleep(0.01)
    finally:
        held.set()
        closer.stop()
