"""A worker that forks (a data loader, a subprocess helper) hands its child a copy of the
backend and of its socket. The child's calls would go out on the parent's connection, as
the parent's rank, and its close() would shut that connection down: the child gets a
MisuseError for every call, its close() lets go of its own copy only, and the parent's
world goes on as if nothing happened."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from client import CommError, hostmem
from commd.launch import DaemonProcess
from tests.fault.ranks import joined, own_daemon, summed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


def test_a_forked_childs_calls_and_close_leave_the_parents_world_be(daemon: DaemonProcess) -> None:
    bufs = [hostmem.alloc(64), hostmem.alloc(64)]
    with joined(daemon, 5) as comms:
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # (the child reports through the pipe and leaves without Python's exit)
            seen: dict[str, object] = {}
            try:
                os.close(read_end)
                try:
                    comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")
                    seen["all_reduce"] = "done"
                except CommError as exc:
                    seen["all_reduce"] = [type(exc).__name__, str(exc)]
                seen["healthy"] = comms[0].is_healthy()
                comms[0].close()
                comms[1].close()
                seen["closed"] = True
            finally:
                os.write(write_end, json.dumps(seen).encode())
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            seen = json.loads(pipe.read())
        assert os.waitpid(child, 0)[1] == 0
        assert seen["all_reduce"][0] == "MisuseError"
        assert f"belongs to process {os.getpid()}" in seen["all_reduce"][1]
        assert seen["healthy"] is False and seen["closed"] is True
        # the parent's ranks: still connected, still one world, results still right
        assert [comm.is_healthy() for comm in comms] == [True, True]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        assert [comm.epoch for comm in comms] == [1, 1]
