"""commd/cluster.py over real loopback TCP: which links a daemon keeps to another."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from commd.cluster import Cluster, WorldNet, parse_address
from commd.errors import CallError, NotListening
from commd.peering import PeerNode, PeerRefusedError
from commd.peerlink import PeerLink, PeerSettings
from proto import peer as p
from tests.integration.harness import eventually

pytestmark = pytest.mark.timeout(30)
SECRET = b"cluster secret"


class Router:
    def __init__(self) -> None:
        self.lost: list[tuple[str, str]] = []

    def on_peer_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None:
        pass

    def on_peer_lost(self, link: PeerLink, reason: str) -> None:
        self.lost.append((link.name, reason))


def process_of(name: str, incarnation: bytes) -> tuple[PeerNode, list[str]]:
    """A daemon process dialing out: its node, and the reasons its links were lost."""
    lost: list[str] = []
    node = PeerNode(PeerSettings(name, SECRET, incarnation=incarnation),
                    lambda *_: None, lambda _link, reason: lost.append(reason))
    return node, lost


async def listening(**settings: float) -> tuple[Cluster, Router, int]:
    cluster, router = Cluster(PeerSettings("A", SECRET, **settings)), Router()
    cluster.router = router
    return cluster, router, await cluster.listen("127.0.0.1", 0)


async def adopted(cluster: Cluster, links: int) -> None:
    """The listener adopts a link once its handshake task ends, after the dial returned."""
    await eventually(lambda: len(cluster.open_links()) == links, f"{links} links adopted")


async def test_links_from_one_process_are_kept_and_lost_one_by_one() -> None:
    cluster, router, port = await listening()
    node, lost = process_of("B", os.urandom(p.INCARNATION_BYTES))
    try:
        first = await node.dial("127.0.0.1", port)
        second = await node.dial("127.0.0.1", port)
        await adopted(cluster, 2)
        assert not first.closed and not second.closed and lost == [] and router.lost == []
        assert sorted(cluster.links) == ["B"]
        second.close("done")  # only the worlds that used it care (someone relaying it, say)
        await eventually(lambda: len(router.lost) == 1, "the listener to lose the link")
        assert not first.closed and [d for d, _ in router.lost] == ["B"] and sorted(cluster.links) == ["B"]
        first.close("done")
        await eventually(lambda: len(router.lost) == 2, "the listener to lose the other link")
        assert [d for d, _ in router.lost] == ["B", "B"] and cluster.links == {}
    finally:
        cluster.close()


async def test_a_new_process_of_a_daemon_links_once_the_old_ones_link_is_lost() -> None:
    """The old process's host went (its link half-open: nothing comes on it). Its restart
    is refused while the old link still counts as alive, then taken once the window has
    judged it lost."""
    cluster, router, port = await listening(heartbeat_s=0.1, window_s=0.6)
    old, _ = process_of("B", os.urandom(p.INCARNATION_BYTES))
    new, new_lost = process_of("B", os.urandom(p.INCARNATION_BYTES))
    try:
        before = await old.dial("127.0.0.1", port)
        await adopted(cluster, 1)
        before._tasks[1].cancel()  # (its heartbeats: the link goes silent, and stays open)
        with pytest.raises(PeerRefusedError, match=r"daemon name 'B' is taken: another process of that "
                                                   r"name is linked to daemon A \(heard 0\.\ds ago"):
            await new.dial("127.0.0.1", port)
        await eventually(lambda: router.lost != [], "the old process's link to be lost")
        assert router.lost[0][0] == "B" and router.lost[0][1].startswith("silent for")
        after = await new.dial("127.0.0.1", port)
        await adopted(cluster, 1)
        assert new_lost == [] and not after.closed
        assert cluster.links["B"].incarnation == new.settings.incarnation
        assert after.incarnation == cluster.settings.incarnation  # (A's, seen by B)
    finally:
        cluster.close()


async def test_a_new_process_of_a_daemon_replaces_old_links_not_yet_judged_lost() -> None:
    """The old process's link fell silent past the window, and A's heartbeat loop has yet
    to judge it (held here): the new process's link is taken, and ends the old one's."""
    cluster, router, port = await listening(heartbeat_s=0.1, window_s=0.3)
    old, old_lost = process_of("B", os.urandom(p.INCARNATION_BYTES))
    new, new_lost = process_of("B", os.urandom(p.INCARNATION_BYTES))
    try:
        before = await old.dial("127.0.0.1", port)
        await adopted(cluster, 1)
        before._tasks[1].cancel()  # (its heartbeats)
        cluster.links["B"]._tasks[1].cancel()  # (A's judgement of the link)
        await asyncio.sleep(0.5)
        after = await new.dial("127.0.0.1", port)
        await eventually(lambda: router.lost != [] and old_lost != [], "the old process's link to go")
        assert router.lost == [("B", "replaced: the daemon runs as a new process")]
        assert new_lost == [] and not after.closed
        assert cluster.links["B"].incarnation == new.settings.incarnation
    finally:
        cluster.close()


async def test_a_second_process_of_one_name_is_refused_while_the_first_speaks() -> None:
    """Two daemons given one name (a copied config): the second's handshake is refused,
    naming the clash, and the first's link stays."""
    cluster, router, port = await listening()
    first, first_lost = process_of("B", os.urandom(p.INCARNATION_BYTES))
    second, _ = process_of("B", os.urandom(p.INCARNATION_BYTES))
    try:
        kept = await first.dial("127.0.0.1", port)
        await adopted(cluster, 1)
        with pytest.raises(PeerRefusedError, match=r"daemon name 'B' is taken: another process of that "
                                                   r"name is linked to daemon A \(heard"):
            await second.dial("127.0.0.1", port)
        await asyncio.sleep(2 * cluster.settings.heartbeat_s)
        assert not kept.closed and first_lost == [] and router.lost == []
        assert cluster.links["B"].incarnation == first.settings.incarnation
    finally:
        cluster.close()


async def test_closing_the_cluster_closes_every_link() -> None:
    cluster, _router, port = await listening()
    node, lost = process_of("B", os.urandom(p.INCARNATION_BYTES))
    links = [await node.dial("127.0.0.1", port) for _ in range(2)]
    await adopted(cluster, 2)
    cluster.close()
    await eventually(lambda: len(lost) == 2, "the dialer to see both links go")
    assert cluster.open_links() == [] and all(link.closed for link in links) and len(lost) == 2


async def test_a_cancelled_dial_does_not_hold_up_the_next_one() -> None:
    """A dial cancelled in its handshake (the daemon stopping a vote) leaves no pending dial
    behind: who waited on it hears why, and the next dial to the address starts afresh."""
    silent = await asyncio.start_server(lambda r, w: asyncio.sleep(30), "127.0.0.1", 0)
    cluster = Cluster(PeerSettings("A", SECRET, handshake_timeout_s=0.5))
    address = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    try:
        first = asyncio.ensure_future(cluster.link_to(address))
        await asyncio.sleep(0.1)
        waiting = asyncio.ensure_future(cluster.link_to(address))  # waits on the first dial
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(CallError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(CallError, match="cannot reach"):  # a new dial, timed out on its own
            await asyncio.wait_for(cluster.link_to(address), 5)
    finally:
        silent.close()
        cluster.close()


async def test_dials_waiting_on_one_whose_link_was_lost_dial_again_once() -> None:
    """Two votes wait on a dial to B whose link is lost as it returns (B stopped), and dial
    B again. Each started a dial of its own, and the first to fail removed the other's from
    the dials under way: the second's failure then raised KeyError, no CallError, and its
    vote task died (the rank was neither answered nor refused until its backstop)."""
    b, _router, port = await listening()
    cluster = Cluster(PeerSettings("C", SECRET, handshake_timeout_s=2))
    real_dial, dials = cluster._node.dial, []

    async def lost_as_it_returns(host: str, port: int) -> PeerLink:
        dials.append(port)
        link = await real_dial(host, port)
        if len(dials) == 1:  # (the race the test cannot time: B stops as the first dial ends)
            b.close()
            link.close("lost")
        return link

    cluster._node.dial = lost_as_it_returns  # type: ignore[method-assign]
    address = f"127.0.0.1:{port}"
    try:
        first = asyncio.ensure_future(cluster.link_to(address))
        await asyncio.sleep(0)
        waiting = [asyncio.ensure_future(cluster.link_to(address)) for _ in range(2)]
        assert (await asyncio.wait_for(first, 5)).closed
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 10)
        assert [type(o) for o in outcomes] == [NotListening, NotListening], outcomes
        assert all(re.match(f"cannot reach the daemon at {address}: ", str(o)) for o in outcomes), outcomes
        assert len(dials) == 2, dials  # the two waiters dialed again once, together
    finally:
        cluster.close()
        b.close()


async def test_a_cancelled_resolve_tells_who_waited_on_it_why() -> None:
    """A world's search for its root cancelled (its rank left) gives those who waited on the
    same search a CallError saying so: before, they got the CancelledError, as if they had
    been cancelled themselves."""
    silent = await asyncio.start_server(lambda r, w: asyncio.sleep(30), "127.0.0.1", 0)
    cluster = Cluster(PeerSettings("A", SECRET, handshake_timeout_s=5))
    net = WorldNet(cluster, "job-1", f"127.0.0.1:{silent.sockets[0].getsockname()[1]}")
    try:
        first = asyncio.ensure_future(net.resolve())
        await asyncio.sleep(0.1)
        waiting = asyncio.ensure_future(net.resolve())  # waits on the first search
        await asyncio.sleep(0.1)
        assert not net.root_known
        first.cancel()
        with pytest.raises(CallError, match="the dial was cancelled"):
            await asyncio.wait_for(waiting, 5)
        assert not net.root_known and net.root is None
    finally:
        silent.close()
        cluster.close()


async def test_a_world_whose_bootstrap_is_our_own_listener_is_rooted_here() -> None:
    cluster, _router, port = await listening()
    try:
        net = WorldNet(cluster, "job-1", f"127.0.0.1:{port}")
        await asyncio.wait_for(net.resolve(), 5)
        assert net.root_known and net.is_root
        made_for_a_member = WorldNet(cluster, "job-2", None)
        assert made_for_a_member.root_known and made_for_a_member.is_root
    finally:
        cluster.close()


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1:7420", ("127.0.0.1", 7420)),
    ("node-3.example:0", ("node-3.example", 0)),
    ("[::1]:9420", ("::1", 9420)),
    ("[fe80::1%eth0]:7420", ("fe80::1%eth0", 7420)),
])
def test_an_address_is_host_and_port(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(("address", "words"), [
    ("[::1:9420", "unbalanced brackets"),  # was taken for ::1 port 9420
    ("::1]:9420", "unbalanced brackets"),
    ("[]:9420", "unbalanced brackets"),
    ("[[::1]]:9420", "unbalanced brackets"),
    ("::1:9420", "IPv6 host goes in brackets"),  # was taken for ::1 port 9420
    ("localhost", "is not HOST:PORT"),
    (":7420", "is not HOST:PORT"),
    ("host:", "is not HOST:PORT"),
    ("host:7\u0664", "is not HOST:PORT"),  # (an Arabic-Indic digit: isdigit() says yes)
    ("127.0.0.1:65536", "port 65536 is not a TCP port"),  # (a dial took it modulo 65536)
])
def test_an_address_that_is_not_host_and_port_is_refused(address: str, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_address(address)
