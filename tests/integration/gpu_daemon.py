"""A real commd Server with the NCCL engine over any `Gpu`, on a loop thread of this
process, for tests whose workers are threads sharing a fake device with it."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

from commd.config import ServerConfig
from commd.engine.gpu import Gpu
from commd.engine.nccl import NcclEngine
from commd.server import Server
from tests.integration.harness import short_tmpdir


class GpuDaemon:
    """The daemon on its own loop thread; `close` stops it and the engine."""

    def __init__(self, gpu: Gpu) -> None:
        self.tmp = short_tmpdir()
        self.socket_path = Path(self.tmp) / "commd.sock"
        self.engine = NcclEngine(gpu)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        stop = asyncio.Event()

        async def serve() -> None:
            server = Server(ServerConfig(socket_path=self.socket_path), self.engine, None)
            server.start()
            started.set()
            try:
                await stop.wait()
            finally:
                server.shutdown()

        self.stop = stop
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)
        self.loop.close()
        self.engine.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
