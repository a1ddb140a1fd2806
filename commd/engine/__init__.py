"""Engines: the code that moves bytes for matched ops (DESIGN §2, `Engine` in base.py)."""

from __future__ import annotations

import logging

from ..errors import ConfigError
from .base import Engine

log = logging.getLogger("commd")


def create_engine(name: str, threads: int | None = None) -> Engine:
    """The engine called `name`; `auto` picks NCCL where a GPU is usable, else host, and
    logs why."""
    if name in ("nccl", "auto"):
        from .gpu import GpuError, load
        from .nccl import NcclEngine

        try:
            engine = NcclEngine(load())
        except GpuError as exc:
            if name == "nccl":
                raise ConfigError(f"engine 'nccl' is not available here: {exc}", key="engine") from None
            log.info("engine auto: host (NCCL is not usable here: %s)", exc)
        else:
            if name == "auto":
                log.info("engine auto: %s", engine.describe())
            return engine
    if name in ("host", "auto"):
        from .host import HostEngine

        return HostEngine(threads=threads)
    raise ConfigError(f"engine {name!r} is not one of host, nccl, auto", key="engine")
