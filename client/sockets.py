"""What the transport needs of Unix sockets beyond the socket module."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Sequence


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
