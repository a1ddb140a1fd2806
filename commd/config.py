"""The daemon's configuration: one frozen object, built once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

DEFAULT_SOCKET = "/run/commd/commd.sock"
SECRET_FILE_ENV = "COMMD_PEER_SECRET_FILE"
SECRET_ENV = "COMMD_PEER_SECRET"


def read_secret(path: str | None, environ: dict[str, str]) -> bytes | None:
    """The shared peer secret: from `path`, else $COMMD_PEER_SECRET_FILE, else
    $COMMD_PEER_SECRET. Never from the command line, where `ps` would show it."""
    path = path or environ.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"peer secret file {path}: {exc.strerror}") from None
        if not secret:
            raise ConfigError(f"peer secret file {path} is empty")
        return secret
    value = environ.get(SECRET_ENV)
    return value.encode() if value else None
ENGINES = ("host", "auto")


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
    threads: int | None = None  # host engine worker threads (default: cores, at most 8)
    log_level: str = "INFO"
    peer_listen: tuple[str, int] | None = None  # TCP address for other daemons
    peer_name: str | None = None  # this daemon's name among them (default: host:port)
    peer_secret: bytes | None = field(default=None, repr=False)  # never printed
    peer_heartbeat_s: float = 0.5
    peer_window_s: float = 3.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        for name in ("max_connections", "max_buffers", "max_registrations", "max_queued_replies",
                     "max_pending_ops", "max_mapped_bytes", "max_daemon_mappings", "max_daemon_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        if self.threads is not None and not 1 <= self.threads <= 256:
            raise ConfigError("threads: must be 1..256")
        if self.peer_secret is not None and len(self.peer_secret) < 16:
            raise ConfigError("peer secret: must be at least 16 bytes")
        if self.peer_listen is not None and self.peer_secret is None:
            raise ConfigError("peer-listen: needs a shared secret (COMMD_PEER_SECRET_FILE or "
                              "--peer-secret-file); daemons never talk unauthenticated")
        if not 0 < self.peer_heartbeat_s < self.peer_window_s:
            raise ConfigError("peer-window: must be longer than the heartbeat interval")
        if len(bytes(self.socket_path)) > 107:
            raise ConfigError(f"socket: path {self.socket_path} is longer than a Unix socket allows")
