"""Run the daemon: engine, server, signals, clean exit."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from .config import ServerConfig
from .engine import create_engine
from .server import Server

log = logging.getLogger("commd")


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM or SIGINT; then fail pending calls, remove the socket, return 0."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = create_engine(config.engine, threads=config.threads)
    server = Server(config, engine)
    try:
        server.start()
        _tune_gc()
        if config.engine == "auto":
            log.info("engine auto: no usable GPU engine here, chose %s", engine.name)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("stopping")
    finally:
        server.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


def _tune_gc() -> None:
    """Latency: each call allocates a few dozen short-lived objects, so the default
    young-generation threshold (700) runs a collection every ~20 calls. Freeze what
    start-up built and collect young objects less often; reference counting frees
    almost everything anyway."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def run(config: ServerConfig) -> int:
    import uvloop

    return uvloop.run(serve(config))
