"""A real commd Server with the NCCL engine over any `Gpu`, on a loop thread of this
process, for tests whose workers are threads sharing a fake device with it."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

from commd.cluster import Cluster
from commd.config import ServerConfig
from commd.engine.gpu import Gpu
from commd.engine.nccl import NcclEngine
from commd.peerlink import PeerSettings
from commd.server import Server
from tests.integration.harness import short_tmpdir


class GpuDaemon:
    """The daemon on its own loop thread; `close` stops it and the engine. With `peer`,
    one of several daemons sharing the device: it listens for the others on loopback
    (`peer_address`)."""

    def __init__(self, gpu: Gpu, peer: PeerSettings | None = None) -> None:
        self.tmp = short_tmpdir()
        self.socket_path = Path(self.tmp) / "commd.sock"
        self.engine = NcclEngine(gpu)
        self.peer_address = ""
        started = threading.Event()
        stop = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            cluster = Cluster(peer) if peer is not None else None
            config = ServerConfig(socket_path=self.socket_path,
                                  peer_secret=peer.secret if peer is not None else None)
            server = Server(config, self.engine, cluster)
            if cluster is not None:
                self.peer_address = f"127.0.0.1:{await cluster.listen('127.0.0.1', 0)}"
            server.start()
            started.set()
            try:
                await stop.wait()
            finally:
                server.shutdown()
                if cluster is not None:
                    cluster.close()

        self.stop = stop
        # asyncio.run, as the daemon: at the end it cancels the tasks still running and waits for them
        self.thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def close(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the daemon's loop did not stop"
        self.engine.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
