"""One daemon, many worlds: what one world's rank asks of the daemon is about that world.
(What other worlds cost a world's calls is measured by scripts/bench_neighbours.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import proto
from client import MisuseError
from commd.launch import DaemonProcess
from commd.status import query_status
from tests.fault.ranks import own_daemon
from tests.integration.harness import world_name
from tests.integration.rawclient import RawClient

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


def busy_world(sock: str, calls: int) -> tuple[RawClient, str]:
    """A one-rank world whose flight recorder holds `calls` barriers, all done."""
    raw, world = RawClient(sock), world_name()
    assert isinstance(raw.join(world), proto.Welcome)
    for request in range(2, 2 + calls):
        raw.send(proto.Submit(request, (proto.Barrier(),)))
        assert raw.recv() == proto.Ok(request)
    return raw, world


def one_worlds_status(sock: str, world: str) -> None:
    info = query_status(sock, 5, world)
    assert [w["name"] for w in info["worlds"]] == [world] and info["worlds_total"] == 1
    assert [c["call"] for c in info["worlds"][0]["recent_calls"]["0"]] == ["barrier()"] * 8


def test_one_worlds_status_among_many_worlds_is_built_for_that_world_alone(daemon: DaemonProcess) -> None:
    """`commd status --world W` built every world's status, flight recorder and all, and
    then kept W's: each such query cost the daemon's loop time for every world there
    (s20/D measured 300 one-rank worlds of 8 calls: 5.6 ms a query against 0.2 ms alone;
    a worker polling its world's status took another world's 1 KiB all_reduce p50 from
    0.25 to 9.6 ms among 100 worlds). Only W's is built now, and shown whole; an unknown
    world is refused as before. (The cost is measured by scripts/bench_neighbours.py.)"""
    sock = str(daemon.socket_path)
    clients = []
    try:
        raw, asked = busy_world(sock, 8)
        clients.append(raw)
        one_worlds_status(sock, asked)
        for _ in range(20):
            clients.append(busy_world(sock, 8)[0])
        one_worlds_status(sock, asked)
        assert query_status(sock, 5)["worlds_total"] == 21
        with pytest.raises(MisuseError, match="no world named 'nowhere'"):
            query_status(sock, 5, "nowhere")
    finally:
        for raw in clients:
            raw.close()
