"""sd_notify datagrams, the watchdog interval, and adopting an inherited socket."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from pathlib import Path

import pytest

from commd.errors import ConfigError
from commd.systemd import Notifier, _adopt, inherited_listener, keep_alive, watchdog_interval

pytestmark = pytest.mark.timeout(10)


def receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_notify_to_a_path(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with receiver(path) as rx:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
        assert notifier.notify("READY=1", "STATUS=serving 0 worlds")
        assert rx.recv(4096) == b"READY=1\nSTATUS=serving 0 worlds"
        notifier.close()


def test_notify_to_an_abstract_address() -> None:
    name = f"commd-test-{uuid.uuid4().hex}"
    with receiver("\0" + name) as rx:
        notifier = Notifier(f"@{name}")
        assert notifier.notify("STOPPING=1")
        assert rx.recv(4096) == b"STOPPING=1"
        notifier.close()


def test_without_notify_socket_nothing_happens() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert not notifier.notify("READY=1")


def test_a_vanished_manager_is_not_an_error(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "gone"))
    assert notifier.notify("WATCHDOG=1") is False
    notifier.close()


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "2000000"}, 1.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 1.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
])
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env, os.getpid()) == expected


def test_watchdog_garbage_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="WATCHDOG_USEC"):
        watchdog_interval({"WATCHDOG_USEC": "soon"}, os.getpid())


@pytest.mark.parametrize("usec", ["1", "99999"])
def test_a_watchdog_too_short_to_ping_is_a_config_error_not_a_busy_loop(usec: str) -> None:
    # It was honoured: WATCHDOG_USEC=1 made the pinger sleep half a microsecond per ping.
    with pytest.raises(ConfigError, match=f"WATCHDOG_USEC={usec}: .* shorter than the 100 ms"):
        watchdog_interval({"WATCHDOG_USEC": usec}, os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "100000"}, os.getpid()) == 0.05


async def test_keep_alive_pings_and_sends_status_only_when_it_changes(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    rx = receiver(path)
    rx.setblocking(False)
    lines = iter(["1 world", "1 world", "2 worlds"])
    last = ["2 worlds"]

    def status() -> str:
        last[0] = next(lines, last[0])
        return last[0]

    notifier = Notifier(path)
    task = asyncio.get_running_loop().create_task(keep_alive(notifier, 0.01, status))
    got: list[bytes] = []
    loop = asyncio.get_running_loop()
    while len(got) < 4:
        got.append(await asyncio.wait_for(loop.sock_recv(rx, 4096), 5))
    task.cancel()
    rx.close()
    notifier.close()
    assert got[0] == b"WATCHDOG=1\nSTATUS=1 world"
    assert got[1] == b"WATCHDOG=1"
    assert got[2] == b"WATCHDOG=1\nSTATUS=2 worlds"
    assert got[3] == b"WATCHDOG=1"


def test_listen_vars_for_another_process_are_left_alone() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1"}
    assert inherited_listener(env, os.getpid()) is None
    assert env == {"LISTEN_PID": "1", "LISTEN_FDS": "1"}


def test_listen_vars_are_removed_once_read() -> None:
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0", "LISTEN_FDNAMES": "x", "OTHER": "y"}
    assert inherited_listener(env, os.getpid()) is None
    assert env == {"OTHER": "y"}


def test_adopt_a_listening_seqpacket_socket(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(tmp_path / "s"))
    sock.listen(4)
    adopted = _adopt(os.dup(sock.fileno()))
    try:
        assert adopted.getsockname() == str(tmp_path / "s")
        assert not os.get_inheritable(adopted.fileno())
    finally:
        adopted.close()
        sock.close()


@pytest.mark.parametrize(("kind", "listen", "problem"), [
    (socket.SOCK_STREAM, True, "not SOCK_SEQPACKET"),
    (socket.SOCK_SEQPACKET, False, "not listening"),
])
def test_adopt_refuses_the_wrong_socket(tmp_path: Path, kind: int, listen: bool, problem: str) -> None:
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.bind(str(tmp_path / "s"))
    if listen:
        sock.listen(4)
    fd = os.dup(sock.fileno())
    try:
        with pytest.raises(ConfigError, match=problem):
            _adopt(fd)
    finally:
        os.close(fd)
        sock.close()


def test_adopt_refuses_a_tcp_socket_and_a_file(tmp_path: Path) -> None:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    fd = os.dup(tcp.fileno())
    try:
        with pytest.raises(ConfigError, match="not AF_UNIX"):
            _adopt(fd)
    finally:
        os.close(fd)
        tcp.close()
    with open(tmp_path / "f", "w") as f, pytest.raises(ConfigError, match="not a usable socket"):
        _adopt(f.fileno())
