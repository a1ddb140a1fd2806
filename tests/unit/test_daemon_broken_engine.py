"""A daemon whose GPU context failed for good (a sticky CUDA error) exits 1, so that its
service manager (Restart=on-failure) starts it afresh: no call could succeed there.
In a subprocess: serve() tunes the process's collector and allocator."""

from __future__ import annotations

import asyncio
import shutil
import signal
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
