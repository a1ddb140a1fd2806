"""The daemon's listener when accept(2) keeps failing: an in-process Server whose listening
socket is wrapped to fail as the kernel may (ENOMEM, ENOBUFS), which nothing here can
provoke for real. Running out of file descriptors is tested for real in
tests/fault/test_limits.py."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from client import DaemonBackend, hostmem
from commd.config import ServerConfig
from commd.engine.host import HostEngine
from commd.server import Server

pytestmark = pytest.mark.timeout(30)


def join(path: Path) -> list[int]:
    """A worker's all_reduce of 5s, alone in its world: what its buffer holds after."""
    buf = hostmem.alloc(8)
    try:
        buf.view(np.uint8)[:] = 5
        with DaemonBackend(str(path), "w", 0, 1, timeout=10) as comm:
            comm.all_reduce(buf.ptr, 8, dtype="u8")
        return [int(x) for x in buf.view(np.uint8)]
    finally:
        buf.close()


class FailingListener:
    """The server's listening socket, whose accept fails while `failing` with `errors` in
    turn, the last repeating (EAGAIN: a wake with nothing to take)."""

    def __init__(self, sock: socket.socket, *errors: int) -> None:
        self._sock, self._errors = sock, errors
        self.failing = True
        self.failed = 0

    def accept(self) -> tuple[socket.socket, object]:
        if self.failing:
            error = self._errors[min(self.failed, len(self._errors) - 1)]
            self.failed += 1
            raise OSError(error, os.strerror(error))  # (EAGAIN makes a BlockingIOError)
        return self._sock.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


@pytest.mark.parametrize("error", [errno.ENOMEM, errno.ENOBUFS])
async def test_an_accept_that_keeps_failing_pauses_the_listener_not_spins_on_it(
        tmp_path: Path, error: int, caplog: pytest.LogCaptureFixture) -> None:
    """accept(2) failing for want of kernel memory, a connection waiting: the listener is
    level-triggered, so returning at once woke it again at once, the loop spun on it and
    logged 'accept failed' at each turn (thousands of lines a second). It now pauses as out
    of fds does (a look every 0.5 s, said once), and serves the waiting worker once accept
    works again."""
    caplog.set_level(logging.INFO, logger="commd.server")
    server = Server(ServerConfig(tmp_path / "d.sock"), HostEngine(threads=1), None)  # type: ignore[arg-type]
    server.start()
    assert server._listener is not None
    failing = FailingListener(server._listener, error)
    server._listener = failing  # type: ignore[assignment]

    try:
        joined = asyncio.ensure_future(asyncio.to_thread(join, tmp_path / "d.sock"))
        await asyncio.sleep(1.2)
        tries = failing.failed
        failing.failing = False
        assert await asyncio.wait_for(joined, 10) == [5] * 8
    finally:
        server.shutdown()
    assert 1 <= tries <= 5, tries  # (a look each 0.5 s; spinning made thousands)
    said = [r.getMessage() for r in caplog.records
            if r.name == "commd.server" and "accepting" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith(f"not accepting connections: accept failed ({os.strerror(error)})"), said
    assert said[1].startswith("accepting connections again, after "), said


async def test_a_paused_listener_says_each_new_reason_once_and_accepting_again_only_once_it_accepted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Paused, the listener said only its first reason: an EMFILE after an ENOMEM (another
    remedy) went unsaid. And a wake with nothing to take (EAGAIN) logged 'accepting
    connections again' though nothing was accepted and the fds were still out: the next
    failure logged the pause anew, a pair of lines per wake. Now a new reason is said once,
    a reason said already is not, and 'again' is said once, when a connection was taken."""
    caplog.set_level(logging.INFO, logger="commd.server")
    server = Server(ServerConfig(tmp_path / "d.sock"), HostEngine(threads=1), None)  # type: ignore[arg-type]
    server.start()
    assert server._listener is not None
    errors = (errno.ENOMEM, errno.EMFILE, errno.EMFILE, errno.EAGAIN, errno.EMFILE, errno.ENOMEM)
    failing = FailingListener(server._listener, *errors)
    server._listener = failing  # type: ignore[assignment]
    try:
        joined = asyncio.ensure_future(asyncio.to_thread(join, tmp_path / "d.sock"))
        for _ in range(100):
            if failing.failed >= len(errors):
                break
            await asyncio.sleep(0.1)
        assert failing.failed >= len(errors), failing.failed
        failing.failing = False
        assert await asyncio.wait_for(joined, 10) == [5] * 8
    finally:
        server.shutdown()
    said = [r.getMessage() for r in caplog.records
            if r.name == "commd.server" and "accepting" in r.getMessage()]
    assert len(said) == 3, said
    assert said[0].startswith("not accepting connections: accept failed (Cannot allocate memory)"), said
    assert said[1] == ("still not accepting connections, now: out of file descriptors "
                       "(Too many open files)"), said
    assert said[2].startswith("accepting connections again, after "), said
