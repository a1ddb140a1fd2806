"""A TCP proxy between daemons that misbehaves on command (after asyncpg's TCPFuzzingProxy).

It runs in a process of its own (its event loop never shares the test's
interpreter) and forwards bytes both ways, until told to:

- `cut()`: drop every connection now and refuse new ones (a network that is gone);
- `drop()`: keep connections open but forward nothing, either way (a black hole);
- `half_open()`: forward only from the dialer to the target (replies vanish);
- `delay(seconds)`: hold every piece of data that long before forwarding it;
- `heal()`: back to normal (for new connections; a stream that lost bytes stays broken).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
from multiprocessing.connection import Connection


class _Proxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.writers: set[asyncio.StreamWriter] = set()
        self.cut = False
        self.blocked: set[str] = set()  # directions that forward nothing: "up", "down"
        self.delay = 0.0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.writers.update((writer, up_writer))
        # Cancelled, the proxy is closing, and this connection ends with it; not re-raised:
        # 3.11's start_server asks the task for its exception, which a cancelled one raises
        # there, printed as "Exception in callback"
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self.pipe(reader, up_writer, "up"), self.pipe(up_reader, writer, "down"),
                                 return_exceptions=True)

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   direction: str) -> None:
        try:
            while data := await reader.read(1 << 16):
                if direction in self.blocked:
                    continue  # swallowed
                if self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self.writers.discard(writer)

    def drop_all(self) -> None:
        self.cut = True
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()


def _main(target: tuple[str, int], control: Connection) -> None:
    async def run() -> None:
        proxy = _Proxy(target)
        server = await asyncio.start_server(proxy.serve, "127.0.0.1", 0)
        control.send(server.sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            what, arg = control.recv()
            if what == "cut":
                proxy.drop_all()
            elif what == "drop":
                proxy.blocked = {"up", "down"}
            elif what == "half_open":
                proxy.blocked = {"down"}
            elif what == "delay":
                proxy.delay = float(arg)
            elif what == "heal":
                proxy.cut, proxy.blocked, proxy.delay = False, set(), 0.0
            elif not done.done():
                done.set_result(None)
            control.send("ok")

        loop.add_reader(control.fileno(), command)
        await done
        server.close()

    asyncio.run(run())


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        ctx = mp.get_context("spawn")
        self._control, child = ctx.Pipe()
        self._proc = ctx.Process(target=_main, args=((target_host, target_port), child), daemon=True)
        self._proc.start()
        if not self._control.poll(20):
            raise RuntimeError("the proxy did not start")
        self.port: int = self._control.recv()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _say(self, what: str, arg: float = 0.0) -> None:
        self._control.send((what, arg))
        if not self._control.poll(10):
            raise RuntimeError(f"the proxy did not answer {what!r}")
        self._control.recv()

    def cut(self) -> None:
        """Drop every connection now and refuse new ones: the network between is gone."""
        self._say("cut")

    def drop(self) -> None:
        self._say("drop")

    def half_open(self) -> None:
        self._say("half_open")

    def delay(self, seconds: float) -> None:
        self._say("delay", seconds)

    def heal(self) -> None:
        self._say("heal")

    def close(self) -> None:
        try:
            self._say("close")
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
