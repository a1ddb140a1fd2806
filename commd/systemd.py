"""Running under systemd: readiness and watchdog notifications, socket activation.

The sd_notify protocol is one datagram of newline-separated `KEY=VALUE` lines
to the AF_UNIX socket named by $NOTIFY_SOCKET (a leading `@` means Linux's
abstract namespace). Spoken directly here: it is ten lines, and a library
would be a dependency for every installation. Without $NOTIFY_SOCKET every
call is a no-op, so the daemon runs the same by hand, in tests and in pods.

Socket activation: systemd passes listening sockets from fd 3 on and says so
in $LISTEN_PID / $LISTEN_FDS; we adopt fd 3 and leave the socket file, which
systemd made and owns, where it is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping

from .errors import ConfigError

log = logging.getLogger("commd.systemd")

LISTEN_FDS_START = 3
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
STATUS_INTERVAL_S = 2.0  # STATUS= is for humans reading `systemctl status`: seconds are fine
# The pings run on the event loop, at half the watchdog: under 0.1 s they would crowd it
# (WATCHDOG_USEC=1 had it ping every half microsecond), and a loop busy with a large status
# report or a world of thousands of ranks forming goes longer than that between them.
MIN_WATCHDOG_USEC = 100_000


class Notifier:
    """Sends sd_notify messages; every method is a no-op when there is no socket."""

    def __init__(self, address: str | None) -> None:
        self._address = None if not address else ("\0" + address[1:] if address[0] == "@" else address)
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Notifier:
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        """Send one message; False when it could not be (never raises, never blocks: a
        full or vanished manager socket must not stop the daemon)."""
        if self._sock is None or self._address is None or not lines:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self._address)
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", lines[0], exc)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC, as sd_watchdog_enabled
    advises), or None when the watchdog is off or meant for another process."""
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    owner = environ.get("WATCHDOG_PID")
    try:
        if owner and int(owner) != pid:
            return None
        value = int(usec)
    except ValueError:
        raise ConfigError(f"WATCHDOG_USEC={usec!r} / WATCHDOG_PID={owner!r}: not integers") from None
    if value <= 0:
        return None
    if value < MIN_WATCHDOG_USEC:
        raise ConfigError(f"WATCHDOG_USEC={value}: the unit's WatchdogSec= is shorter than the "
                          f"{MIN_WATCHDOG_USEC // 1000} ms commd needs between pings; set it to a "
                          "few seconds at least (deploy/commd.service has 30s)")
    return value / 2e6


async def keep_alive(notifier: Notifier, watchdog_s: float | None, status: Callable[[], str]) -> None:
    """Ping the watchdog and refresh STATUS= until cancelled. It runs on the event loop on
    purpose: a wedged loop stops the pings and systemd restarts the daemon."""
    tick = STATUS_INTERVAL_S if watchdog_s is None else min(watchdog_s, STATUS_INTERVAL_S)
    last = ""
    while True:
        await asyncio.sleep(tick)
        lines = ["WATCHDOG=1"] if watchdog_s is not None else []
        try:
            line = status()
        except Exception as exc:  # a status that cannot be told must not stop the pings
            line = f"status unavailable: {type(exc).__name__}"
        if line != last:
            lines.append("STATUS=" + line)
            last = line
        notifier.notify(*lines)


def inherited_listener(environ: MutableMapping[str, str], pid: int) -> socket.socket | None:
    """The listening socket systemd passed us (fd 3), or None when not socket-activated.

    The LISTEN_* variables are removed once read, so that no child process believes
    the socket is its own."""
    listen_pid, count = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    if listen_pid is None or count is None:
        return None
    try:
        ours, n = int(listen_pid) == pid, int(count)
    except ValueError:
        raise ConfigError(f"socket activation: LISTEN_PID={listen_pid!r} LISTEN_FDS={count!r} "
                          "are not integers") from None
    if not ours:
        return None  # meant for the process that started us
    for name in _LISTEN_VARS:
        environ.pop(name, None)
    if n < 1:
        return None
    if n > 1:
        log.warning("socket activation passed %d sockets; using fd %d only", n, LISTEN_FDS_START)
    return _adopt(LISTEN_FDS_START)


def _adopt(fd: int) -> socket.socket:
    try:
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"socket activation: fd {fd} is not a usable socket: {exc.strerror}") from None
    problem = None
    if sock.family != socket.AF_UNIX:
        problem = f"its family is {sock.family.name}, not AF_UNIX"
    elif sock.type != socket.SOCK_SEQPACKET:
        problem = f"its type is {sock.type.name}, not SOCK_SEQPACKET (ListenSequentialPacket=)"
    elif not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        problem = "it is not listening"
    if problem is not None:
        sock.detach()  # the fd is systemd's: not ours to close
        raise ConfigError(f"socket activation: the socket passed as fd {fd} cannot serve: {problem}")
    return sock
