"""A daemon whose GPU context failed for good (a sticky CUDA error) exits 1, so that its
service manager (Restart=on-failure) starts it afresh: no call could succeed there.
In a subprocess: serve() tunes the process's collector and allocator."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import proto
from commd.config import ServerConfig
from commd.daemon import serve
from commd.errors import ConfigError
from commd.launch import wait_for_socket
from commd.status import query_status
from proto import ErrorCode
from tests.integration.harness import short_tmpdir, world_name
from tests.integration.rawclient import RawClient

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import asyncio, sys
from pathlib import Path
from commd.config import ServerConfig
from commd.daemon import serve
from commd.engine.nccl import NcclEngine
from tests.contract.fakegpu import FakeGpu

gpu = FakeGpu()

async def main() -> int:
    ready = asyncio.Event()
    config = ServerConfig(socket_path=Path(sys.argv[1]))
    served = asyncio.ensure_future(serve(config, ready, {}, NcclEngine(gpu)))
    await ready.wait()
    if sys.argv[2] == "break":
        gpu.broken_reason = "cuEventSynchronize: an illegal memory access was encountered"
        return await asyncio.wait_for(served, 10)
    await asyncio.sleep(1.5)  # several checks of the engine: it is fine
    print("still serving", served.done(), flush=True)
    served.cancel()
    return 0

sys.exit(asyncio.run(main()))
"""


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(short_tmpdir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("breaks", [True, False])
def test_a_broken_engine_ends_the_daemon_with_status_1(breaks: bool, sock_dir: Path) -> None:
    socket = sock_dir / "commd.sock"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(socket), "break" if breaks else "keep"],
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=40)
    if breaks:
        assert done.returncode == 1, done.stderr[-2000:]
        assert "the engine can serve no more (cuEventSynchronize: an illegal memory access" in done.stderr
        assert not socket.exists()  # it shut down cleanly on its way out
    else:
        assert done.returncode == 0 and "still serving False" in done.stdout, done.stderr[-2000:]


def test_a_serve_that_cannot_start_puts_the_signal_handlers_back(sock_dir: Path) -> None:
    """Its handlers set a stopped loop's event: left behind, a later SIGTERM in the same
    process raised 'Event loop is closed' instead of doing what it did before."""
    before = signal.getsignal(signal.SIGTERM)
    config = ServerConfig(socket_path=sock_dir / "commd.sock", engine="nccl")
    with pytest.raises(ConfigError):  # no GPU here (or a stand-in driver without one)
        asyncio.run(serve(config))
    assert signal.getsignal(signal.SIGTERM) is before


BUGGY = r"""
import asyncio, sys
from pathlib import Path
from commd.config import ServerConfig
from commd.daemon import serve
from commd.engine.host import HostEngine

class Buggy(HostEngine):
    def import_memory(self, *args, **kwargs):
        raise RuntimeError("a bug with a long message: " + "x" * 5000)

sys.exit(asyncio.run(serve(ServerConfig(socket_path=Path(sys.argv[1])), None, {}, Buggy())))
"""


def test_a_daemon_bug_with_a_long_message_is_answered_internal_and_closed(sock_dir: Path) -> None:
    """A handler's unexpected exception is answered INTERNAL and the connection closed.
    Its repr went into the error whole: past the 4096 characters an error may carry,
    building the reply raised inside the handler's except, the exception escaped to the
    loop, and the client got neither a reply nor a close (it waited out its timeout)."""
    path = sock_dir / "commd.sock"
    daemon = subprocess.Popen([sys.executable, "-c", BUGGY, str(path)], cwd=REPO,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_socket(path, 20, daemon)
        with RawClient(str(path), timeout=5) as raw:
            assert isinstance(raw.join(world_name()), proto.Welcome)
            reply = raw.import_memfd(2, 1, 4096)
            assert isinstance(reply, proto.Error), reply
            assert (reply.id, reply.code) == (2, ErrorCode.INTERNAL), reply
            assert reply.message.startswith("daemon bug: RuntimeError('a bug with a long message: xxx")
            assert raw.closed()
        assert query_status(str(path), 5)["connections"] == 1  # (this query's: the daemon goes on)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(20) == 0


CLOSE_FAILS = r"""
import asyncio, os, signal, socket, sys
from pathlib import Path
from commd.config import ServerConfig
from commd.daemon import serve
from commd.engine.host import HostEngine
from commd.status import query_status

class CloseFails(HostEngine):
    def close(self):
        super().close()
        raise RuntimeError("planted: the engine did not close")

def open_fds():
    return len(os.listdir("/proc/self/fd"))

async def main() -> None:
    ready = asyncio.Event()
    config = ServerConfig(socket_path=Path(sys.argv[1]), peer_listen=("127.0.0.1", 0),
                          peer_secret=b"s" * 32)
    before = open_fds()
    served = asyncio.ensure_future(serve(config, ready, {"NOTIFY_SOCKET": sys.argv[2]}, CloseFails()))
    await ready.wait()
    port = (await asyncio.to_thread(query_status, sys.argv[1], 5))["peers"]["port"]
    os.kill(os.getpid(), signal.SIGTERM)
    try:
        await served
    except RuntimeError as exc:
        print("raised:", exc)
    try:
        socket.create_connection(("127.0.0.1", port), 2).close()
        print("peer port: open")
    except ConnectionRefusedError:
        print("peer port: closed")
    print("fds left open:", open_fds() - before)

asyncio.run(main())
"""


def test_a_shutdown_that_raises_still_bids_farewell_and_closes_the_notifier(sock_dir: Path) -> None:
    """The engine's close fails as the daemon stops (server.shutdown raises): the steps after
    it were skipped, the peer port left listening (the other daemons not bid farewell) and
    the sd_notify socket open. Every step is taken, then the engine's error is raised."""
    notify = sock_dir / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(str(notify))
        done = subprocess.run([sys.executable, "-c", CLOSE_FAILS, str(sock_dir / "commd.sock"), str(notify)],
                              cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=40)
        manager.setblocking(False)
        said = [manager.recv(4096).decode().split("\n")[0] for _ in range(2)]
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["raised: planted: the engine did not close", "peer port: closed",
                                        "fds left open: 0"], done.stderr[-2000:]
    assert said == ["READY=1", "STOPPING=1"]
