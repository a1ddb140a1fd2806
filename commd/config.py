"""The daemon's configuration: one frozen object, built once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

DEFAULT_SOCKET = "/run/commd/commd.sock"
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
    threads: int | None = None  # host engine worker threads (default: cores, at most 8)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        for name in ("max_connections", "max_buffers", "max_registrations", "max_queued_replies"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        if self.threads is not None and not 1 <= self.threads <= 256:
            raise ConfigError("threads: must be 1..256")
        if len(bytes(self.socket_path)) > 107:
            raise ConfigError(f"socket: path {self.socket_path} is longer than a Unix socket allows")
