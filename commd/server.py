"""The Unix socket: create it safely, admit allowed peers, stop cleanly.

The socket is SOCK_SEQPACKET, mode 0660, in a runtime directory of mode 0750
(created if absent). Each connection's SO_PEERCRED uid/gid is checked against
the allow-list before a single byte is read from it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import socket
import stat
import struct
import time
from typing import Any

import proto
from proto import ErrorCode

from . import __version__, build_line
from .channel import FdCloser, Lingering, PacketChannel, linger_close
from .cluster import Cluster
from .config import ServerConfig, utf8_text
from .engine.base import Engine
from .errors import ConfigError
from .logs import Throttled
from .registry import Registry
from .session import DaemonContext, MemoryBudget, Session
from .stats import DaemonStats
from .world import WorldState

log = logging.getLogger("commd.server")
_UCRED = struct.Struct("3i")
# Connections past max_connections that may still ask for the status, never join: a daemon
# full of workers must answer `commd status`, the probe that tells a supervisor it lives
# (a Kubernetes liveness probe failing there restarts it, failing every world it serves)
STATUS_HEADROOM = 4


def _warn_if_open_to_all(directory: str) -> None:
    """Warn if the socket's `directory`, or one above it, is writable by every user with no
    sticky bit: any of them may then put a socket of their own where workers connect (in
    the directory, or in a directory of theirs moved into its place). With the sticky bit,
    as /tmp has, only an entry's owner may replace it."""
    own = directory = os.path.abspath(directory)
    while True:
        mode = os.stat(directory).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            what = f"its directory {own}" if directory == own else f"{directory}, above its directory {own},"
            log.warning("socket: %s is writable by every user: any of them may replace the socket with "
                        "one of their own, which workers would then trust; use a directory only commd's "
                        "group can write, or set its sticky bit", what)
            return
        above = os.path.dirname(directory)
        if above == directory:
            return
        directory = above


def bind_socket(path: os.PathLike[str] | str) -> socket.socket:
    """Bind a SEQPACKET listener at `path`, replacing a stale socket file, never a live one."""
    path = os.fspath(path)
    parent = os.path.dirname(path) or "."
    # Each directory made, not only the socket's own (makedirs gives those above it the umask's
    # mode: 0700 shuts the group's workers out, 0770 lets them move the socket's directory)
    missing = []
    while parent and not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o750)
            os.chmod(directory, 0o750)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise ConfigError(f"socket: cannot create the directory {directory}: a file is there",
                                  key="socket_path") from None
        except OSError as exc:
            raise ConfigError(f"socket: cannot create the directory {directory}: {exc.strerror}",
                              key="socket_path") from None
    _warn_if_open_to_all(os.path.dirname(path) or ".")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"socket: {path} exists and is not a socket", key="socket_path")
        # Non-blocking: a listener whose backlog is full (a stopped daemon) made a blocking
        # connect wait for good, and start-up with it, without a word
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            probe.connect(path)
            raise ConfigError(f"socket: another daemon is listening on {path}", key="socket_path")
        except BlockingIOError:
            raise ConfigError(f"socket: another daemon is listening on {path} (its backlog is "
                              "full: it does not accept connections)", key="socket_path") from None
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ConfigError(f"socket: cannot probe {path}: {exc}", key="socket_path") from None
        finally:
            probe.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # (gone since the probe: nothing to replace)
        except OSError as exc:
            raise ConfigError(f"socket: cannot remove the stale socket file {path} (no daemon listens "
                              f"there): {exc.strerror}", key="socket_path") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        old_umask = os.umask(0o117)  # the file is born 0660: no window where others may connect
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o660)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"socket: cannot listen on {path}: {exc.strerror}", key="socket_path") from None
    except BaseException:
        sock.close()
        raise
    return sock


class Server:
    def __init__(self, config: ServerConfig, engine: Engine, cluster: Cluster | None = None) -> None:
        self.config = config
        self.engine = engine
        self.cluster = cluster
        self.registry = Registry(engine, config.max_pending_ops, cluster, DaemonStats(),
                                 max_forming_worlds=config.max_forming_worlds,
                                 max_call_timeout_s=config.max_call_timeout_s)
        self.sessions: set[Session] = set()
        self._lingering = Lingering(config.max_connections)  # closed ones, saying their last word
        self._closer = FdCloser()  # of the fds clients send
        self._refusals = Throttled(log)
        self._paused_since: float | None = None  # out of fds: since when accepting is paused
        self._pause_reasons: set[str] = set()  # those said during this pause
        self._listener: socket.socket | None = None
        self._owns_path = False  # an inherited (socket-activated) socket's file is systemd's
        self._socket_file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we bound
        self._started = time.time()
        self.metrics_address: str | None = None  # where /metrics is served, once it is
        budget = MemoryBudget(config.max_daemon_mappings, config.max_daemon_bytes)
        self._ctx = DaemonContext(config, engine, self.registry, self.status, budget, Throttled(log),
                                  self._closer)

    def start(self, inherited: socket.socket | None = None) -> None:
        """Listen on the configured path, or on `inherited` (socket activation)."""
        if inherited is None:
            self._listener = bind_socket(self.config.socket_path)
            self._owns_path = True
            self._socket_file = _file_id(self.config.socket_path)
        else:
            self._listener = inherited
            bound = inherited.getsockname()
            if bound != os.fspath(self.config.socket_path):
                log.warning("the inherited socket is bound to %r, not the configured %s: "
                            "clients and `commd status` must use the former", bound,
                            self.config.socket_path)
        self._listener.setblocking(False)
        asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)
        log.info("%s listening on %s (engine %s%s)", build_line(), self.config.socket_path,
                 self.engine.describe(), "" if inherited is None else ", socket inherited: socket activation")

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                # Not "accepting again": nothing was taken, so the fds may still be out, and
                # saying it here made a pause/again pair of lines at each wake with nothing to take
                return
            except ConnectionAbortedError:
                continue  # (that one gave up in the backlog: the next may be there)
            except OSError as exc:
                # Level-triggered: the pending connection would wake us again at once (the
                # loop spun on an ENOMEM, logging each turn). Pause accepting until it passes.
                out_of_fds = exc.errno in (errno.EMFILE, errno.ENFILE)
                self._pause_accepting(f"{'out of file descriptors' if out_of_fds else 'accept failed'} "
                                      f"({exc.strerror})")
                return
            self._accepting_again()
            pid, uid, gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            refusal = self._refusal(sock, pid, uid, gid)
            if refusal is not None:
                self._refusals.warning("refused pid %d uid %d gid %d: %s", pid, uid, gid, refusal[1])
                _refuse(sock, *refusal, self._lingering, self._closer)
                continue
            self._open_session(sock, pid)

    def _pause_accepting(self, why: str, seconds: float = 0.5) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._listener.fileno())
        # Once, not at each look: an hour out of fds logged 7200 lines that said nothing new.
        # A reason not yet said is, though: an EMFILE after an ENOMEM needs another remedy.
        if self._paused_since is None:
            self._paused_since = time.monotonic()
            log.warning("not accepting connections: %s (looking again every %.1fs; the "
                        "connecting ones wait)", why, seconds)
        elif why not in self._pause_reasons:
            log.warning("still not accepting connections, now: %s", why)
        self._pause_reasons.add(why)

        def resume() -> None:
            if self._listener is not None:
                loop.add_reader(self._listener.fileno(), self._accept)

        loop.call_later(seconds, resume)

    def _accepting_again(self) -> None:
        if self._paused_since is not None:
            log.info("accepting connections again, after %.1fs paused", time.monotonic() - self._paused_since)
            self._paused_since = None
            self._pause_reasons.clear()

    def _refusal(self, sock: socket.socket, pid: int, uid: int, gid: int) -> tuple[ErrorCode, str] | None:
        allowed = self.config.allow_gids
        if uid not in self.config.allow_uids and gid not in allowed and not (
                allowed and allowed & supplementary_groups(sock, pid)):
            return ErrorCode.PERMISSION, f"uid {uid} / gid {gid} may not use this daemon"
        if len(self.sessions) >= self.config.max_connections + STATUS_HEADROOM:
            return ErrorCode.LIMIT, self._full()
        return None

    def _full(self) -> str:
        return f"the daemon holds its limit of {self.config.max_connections} connections"

    def _open_session(self, sock: socket.socket, pid: int) -> None:
        status_only = len(self.sessions) >= self.config.max_connections
        def make_channel(session: Session) -> PacketChannel:
            def closed(reason: str) -> None:
                self.sessions.discard(session)
                session.on_close(reason)

            return PacketChannel(sock, proto.MAX_MESSAGE_BYTES, self.config.max_queued_replies,
                                 session.on_packet, closed, self._lingering, self._closer)

        self.sessions.add(Session(self._ctx, pid, make_channel, self._full() if status_only else None))

    def status(self, world: str | None = None) -> dict[str, Any]:
        """The daemon's status, with every world or only `world` (see Registry.status)."""
        return {
            "version": __version__,
            "engine": self.engine.name,
            "engine_detail": self.engine.describe(),
            "pid": os.getpid(),
            "uptime_s": self.uptime(),
            "connections": len(self.sessions),
            "ranks_connected": self.registry.connected_ranks(),
            "fd_closes_held": len(self._closer.held()),  # (each holds the daemon's exit: README, FUSE)
            "socket": utf8_text(self.config.socket_path),
            "socket_activated": self._listener is not None and not self._owns_path,
            "metrics": self.metrics_address,
            "config": self.config.public(),
            "counters": self.registry.stats.summary(),
            "worlds": self.registry.status(world),
            "peers": self.cluster.status() if self.cluster is not None else None,
        }

    def uptime(self) -> float:
        return round(time.time() - self._started, 3)

    def status_line(self) -> str:
        """One line for systemd's STATUS= (what `systemctl status` shows)."""
        worlds = self.registry.worlds.values()
        ready = sum(1 for w in worlds if w.state is WorldState.READY)
        return (f"serving {len(worlds)} worlds ({ready} ready), {self.registry.connected_ranks()} "
                f"ranks, {len(self.sessions)} connections")

    def shutdown(self) -> None:
        """Fail pending calls with SHUTDOWN, tell every client, close, remove the socket file
        (only one we created: a socket-activated one belongs to systemd)."""
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            # Only the file we bound: once ours was removed, the path may be another daemon's,
            # live, whose clients would lose it
            if self._owns_path and _file_id(self.config.socket_path) == self._socket_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.config.socket_path)
        message = "the daemon is shutting down"
        self.registry.shutdown(message)
        # The calls whose ops the engine still runs went unanswered (World.shutdown), and a
        # worker takes its buffers back once it hears of the stop: it hears once the engine
        # let go of them (its jobs ended, NCCL's aborts returned). On device memory the
        # client has no mapping of ours to move them off first.
        self.engine.close()
        # (what a rank's next call raises: the world's own calls said it already)
        event = proto.Event(proto.EventKind.SHUTDOWN, ErrorCode.SHUTDOWN,
                            f"{message}; call attempt_reconnect once it is back")
        for session in list(self.sessions):
            session.send(event)
            session.channel.close("shutdown", discard_input=True)
        self._closer.stop()


def _file_id(path: os.PathLike[str] | str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def supplementary_groups(sock: socket.socket, pid: int) -> frozenset[int]:
    """The groups a connecting process holds besides its primary one (SO_PEERCRED tells
    only that): a worker admitted as a member of `commd` has it as a supplementary group.
    SO_PEERGROUPS gives the groups of the socket's peer as they were at connect, also
    from another PID namespace (a pod); /proc/PID/status is the fallback."""
    raw: bytes | None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 256)  # gid_t each
    except OSError as exc:
        # more than fit: Python's getsockopt takes at most 1024 bytes, so ask libc
        raw = _many_peer_groups(sock.fileno()) if exc.errno == errno.ERANGE else None
    if raw is not None:
        return frozenset(array.array("I", raw[:len(raw) - len(raw) % 4]))
    try:  # an older kernel: ask /proc
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def _many_peer_groups(fd: int) -> bytes | None:
    """SO_PEERGROUPS into a buffer as large as the kernel says it needs (NGROUPS_MAX is 65536)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = ctypes.c_uint32(4 * 65536)
    buf = ctypes.create_string_buffer(size.value)
    if libc.getsockopt(fd, socket.SOL_SOCKET, _SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        return None
    return buf.raw[:size.value]


def _refuse(sock: socket.socket, code: ErrorCode, message: str, lingering: Lingering,
            closer: FdCloser) -> None:
    try:
        sock.setblocking(False)
        sock.send(proto.encode(proto.Error(0, code, message)))
    except OSError:
        sock.close()
        return
    linger_close(sock, lingering=lingering, closer=closer)
