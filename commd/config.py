"""The daemon's configuration: one frozen object, built once at start."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from proto.peer import MAX_DAEMON_NAME

from .errors import ConfigError

DEFAULT_SOCKET = "/run/commd/commd.sock"
SECRET_FILE_ENV = "COMMD_PEER_SECRET_FILE"
SECRET_ENV = "COMMD_PEER_SECRET"


MAX_LIMIT = (1 << 63) - 1  # a limit travels in status reports as a msgpack integer
MAX_ID = (1 << 32) - 2  # uids and gids: (uid_t)-1 means "none"
MIN_TIMER_S = 0.01  # the shortest hello_timeout and peer_heartbeat
# What one world may hold of other daemons' data that no op has taken yet (max_peer_held_bytes):
# 64 streams' windows (hostnet's flow control holds each to 16 MiB)
DEFAULT_MAX_HELD_BYTES = 1 << 30


def utf8_text(text: str | os.PathLike[str]) -> str:
    """`text` as the UTF-8 that a status report or a peer handshake must carry: a path (or a
    name the system gave) need not be UTF-8, and its undecodable bytes, held as lone
    surrogates, made the encoder fail; they are backslash-escaped instead."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def read_small_file(path: str, limit: int, what: str, key: str | None = None) -> bytes:
    """A regular file of at most `limit` bytes: a FIFO would block start-up for ever, and
    /dev/zero would fill the memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", key=key) from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}", key=key) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{what} {path} is not a regular file", key=key)
        data = b""
        while len(data) <= limit:  # (a read may return less than asked)
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}", key=key) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(f"{what} {path} is larger than {limit} bytes", key=key)
    return data


def located(exc: ConfigError, sources: Mapping[str, str]) -> ConfigError:
    """`exc`, saying where the value it blames came from (`sources`: by key, as
    ServerConfig.sources): found as the settings are read, or only as the daemon starts."""
    name = KEY_OF_FIELD.get(exc.key or "", exc.key or "")
    where = sources.get(name)
    return exc if where is None else ConfigError(f"{exc} ({where})", key=name)


def secret_of(given: bytes) -> bytes:
    """The secret in what a file or $COMMD_PEER_SECRET holds: a file's trailing newline
    (`openssl rand -hex 32 > file`) is not part of it, and the same text given either way
    must be the same secret, or the daemons refuse each other."""
    return given.strip()


def read_secret_file(path: str) -> bytes:
    """The shared peer secret, from a file: never from the command line, where `ps` would
    show it, nor from the config file itself, which is world-readable more often than not."""
    secret = secret_of(read_small_file(path, 4096, "peer secret file", key="peer_secret_file"))
    if not secret:
        raise ConfigError(f"peer secret file {path} is empty", key="peer_secret_file")
    return secret


ENGINES = ("host", "nccl", "auto")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
# The settings' names (config file, COMMD_<KEY>, --flag) where they differ from the fields'
KEY_OF_FIELD = {"socket_path": "socket", "peer_heartbeat_s": "peer_heartbeat",
                "peer_window_s": "peer_window", "peer_secret": "peer_secret_file",
                "hello_timeout_s": "hello_timeout", "max_call_timeout_s": "max_call_timeout"}
# The flags not named --<key>: a repeatable one is singular, and --metrics is short
_FLAG_OF_KEY = {"metrics_listen": "--metrics", "allow_uids": "--allow-uid", "allow_gids": "--allow-gid",
                "allow_groups": "--allow-group"}


def flag_of(key: str) -> str:
    """The `commd serve` flag that sets settings key `key`."""
    return _FLAG_OF_KEY.get(key, "--" + key.replace("_", "-"))


# every limit: a ServerConfig field, a config key, COMMD_<KEY> and --flag alike
LIMITS = ("max_connections", "max_buffers", "max_registrations", "max_queued_replies",
           "max_pending_ops", "max_mapped_bytes", "max_daemon_mappings", "max_daemon_bytes",
           "max_forming_worlds", "max_peer_held_bytes")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket_path: Path
    engine: str = "host"
    allow_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid(), 0}))
    allow_gids: frozenset[int] = frozenset()
    max_connections: int = 1024
    max_buffers: int = 4096  # imported + symmetric buffers per connection
    max_registrations: int = 4096  # register_buffer handles per connection
    max_queued_replies: int = 4096  # replies a client may leave unread
    max_pending_ops: int = 4096  # calls a rank may have waiting for their match
    max_mapped_bytes: int = 1 << 40  # bytes one connection may map (imports + symmetric)
    max_daemon_mappings: int = 32768  # buffers the whole daemon maps (vm.max_map_count ~65k)
    max_daemon_bytes: int = 32 << 40  # address space the whole daemon maps
    max_forming_worlds: int = 1024  # worlds held for other daemons' votes, rank 0 not here yet
    max_peer_held_bytes: int = DEFAULT_MAX_HELD_BYTES  # other daemons' data a world holds, no op took yet
    threads: int | None = None  # host engine worker threads (default: cores, at most 8)
    log_level: str = "INFO"
    log_format: str = "text"  # or "json": one object per line, for log shippers
    metrics_listen: tuple[str, int] | None = None  # Prometheus /metrics (None: off)
    peer_listen: tuple[str, int] | None = None  # TCP address for other daemons
    peer_name: str | None = None  # this daemon's name among them (default_peer_name)
    peer_secret: bytes | None = field(default=None, repr=False)  # never printed
    peer_heartbeat_s: float = 0.5
    peer_window_s: float = 3.0
    # a connection that is no rank says something (its hello, a status query) within this
    # of connecting or of the answer to its last status query, or is closed: an idle one would hold one
    # of max_connections for ever
    hello_timeout_s: float = 10.0
    # the longest a call may stay open before it fails its world, whatever its rank's
    # timeout asks (None: as it asks; recv_command_u32 waits without one all the same)
    max_call_timeout_s: float | None = None
    # where each key given came from ("metrics_listen = '...' from /etc/commd/commd.toml"), for
    # errors found only as the daemon starts (a port in use), after the settings were read
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, value, allowed in (("engine", self.engine, ENGINES),
                                     ("log_level", self.log_level, LOG_LEVELS),
                                     ("log_format", self.log_format, LOG_FORMATS)):
            if value not in allowed:
                raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}", key=name)
        for name in LIMITS:
            if not 1 <= getattr(self, name) <= MAX_LIMIT:
                raise ConfigError(f"{name}: must be 1..{MAX_LIMIT}", key=name)
        for name, ids in (("allow_uids", self.allow_uids), ("allow_gids", self.allow_gids)):
            if any(not 0 <= i <= MAX_ID for i in ids):
                raise ConfigError(f"{KEY_OF_FIELD.get(name, name)}: ids are 0..{MAX_ID}", key=name)
        if self.threads is not None and not 1 <= self.threads <= 256:
            raise ConfigError("threads: must be 1..256", key="threads")
        # (checked here: the handshake refuses to carry it, and a daemon that started with it
        # failed every world across daemons instead)
        if self.peer_name is not None and not 0 < len(self.peer_name) <= MAX_DAEMON_NAME:
            raise ConfigError(f"peer_name: must be 1..{MAX_DAEMON_NAME} characters", key="peer_name")
        if self.peer_secret is not None and len(self.peer_secret) < 16:
            raise ConfigError("peer secret: must be at least 16 bytes", key="peer_secret")
        if self.peer_listen is not None and self.peer_secret is None:
            raise ConfigError("peer_listen: needs a shared secret (peer_secret_file, "
                              "COMMD_PEER_SECRET_FILE or COMMD_PEER_SECRET); daemons never talk "
                              "unauthenticated", key="peer_listen")
        for name in ("peer_heartbeat_s", "peer_window_s", "hello_timeout_s"):  # nan compares false
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{KEY_OF_FIELD[name]}: must be a finite number of seconds", key=name)
        # (timers: 1e-6 closed every connection before its hello could come, and a heartbeat
        # that short floods the peers)
        if self.hello_timeout_s < MIN_TIMER_S:
            raise ConfigError(f"hello_timeout: must be at least {MIN_TIMER_S:g}s", key="hello_timeout_s")
        if self.max_call_timeout_s is not None and not 0 < self.max_call_timeout_s < math.inf:
            raise ConfigError("max_call_timeout: must be a positive, finite number of seconds",
                              key="max_call_timeout_s")
        if self.peer_heartbeat_s < MIN_TIMER_S:
            raise ConfigError(f"peer_heartbeat: must be at least {MIN_TIMER_S:g}s", key="peer_heartbeat_s")
        if self.peer_window_s <= self.peer_heartbeat_s:
            raise ConfigError("peer_window: must be longer than the heartbeat interval "
                              f"({self.peer_heartbeat_s:g}s)", key="peer_window_s")
        if len(bytes(self.socket_path)) > 107:
            raise ConfigError(f"socket: path {self.socket_path} is longer than a Unix socket allows",
                              key="socket_path")

    def public(self) -> dict[str, Any]:
        """The settings by key name, as plain data for `commd status`; of the secret only
        whether it is set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sources":
                continue
            if f.name == "peer_secret":
                out["peer_secret_set"] = value is not None
                continue
            elif isinstance(value, Path):
                value = utf8_text(value)
            elif isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, tuple):
                value = f"{value[0]}:{value[1]}"
            out[KEY_OF_FIELD.get(f.name, f.name)] = value
        return out
