"""The daemons of a cluster: links by name, the root of each world, message routing.

Topology is a star per world: the daemon that hosts rank 0 is the world's root;
every other daemon with ranks of the world (a member) links to it. Bootstrap,
failures and (on the host engine) data all go member ↔ root; the root relays
point-to-point data between two members. A member reaches the root over the
link it dialed; the root answers each member over the link its votes came on.
So a world uses one link per member, and only the loss of a link it uses fails
it: two daemons may hold several links (each dialed the other, for worlds
rooted on either side; or someone relayed a handshake), each lost on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Protocol

from proto import ErrorCode
from proto import peer as p

from .config import DEFAULT_MAX_HELD_BYTES
from .errors import CallError, NotListening, cannot_listen, quoted
from .peering import PeerNode, SelfDialError
from .peerlink import PeerLink, PeerSettings

log = logging.getLogger("commd.cluster")
_STOPPING = "daemon shutting down"  # why a stopping daemon closes its links


class Inbox:
    """Data of one world's epoch, by key; a wait may start before or after its data arrives.

    What arrives before its wait is held here; the senders' windows bound it (see
    hostnet's flow control), and `held_bytes` tells how much it is. A daemon that sends
    what no op will take (a call, step or chunk that is not due) is bound by `limit` alone:
    past it, `deliver` refuses, and the world fails."""

    # What a held frame costs besides its payload (its message, key and slot): empty frames
    # no op takes must reach the limit too.
    FRAME_COST = 1024

    def __init__(self, limit: int = DEFAULT_MAX_HELD_BYTES) -> None:
        self._ready: dict[tuple[str, int, int, int], tuple[p.Data, bytes | bytearray]] = {}
        self._waiting: dict[tuple[str, int, int, int], asyncio.Future[tuple[p.Data, bytes | bytearray]]] = {}
        self._failed: CallError | None = None
        self.held_bytes = 0
        self.limit = limit

    def deliver(self, msg: p.Data, payload: bytes | bytearray) -> None:
        """Hand `payload` to its wait, or hold it for one; CallError if holding it would pass
        the limit."""
        waiter = self._waiting.pop(msg.key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((msg, payload))
            return
        replaced = self._ready.pop(msg.key, None)
        if replaced is not None:
            self.held_bytes -= len(replaced[1])
        if self.held_bytes + len(payload) + self.FRAME_COST * (len(self._ready) + 1) > self.limit:
            raise CallError(ErrorCode.WORLD_FAILED,
                            f"{self.held_bytes} bytes that no op has taken are held, and {len(payload)} "
                            f"more would pass the limit (max_peer_held_bytes) of {self.limit}")
        self._ready[msg.key] = (msg, payload)
        self.held_bytes += len(payload)

    async def get(self, key: tuple[str, int, int, int]) -> tuple[p.Data, bytes | bytearray]:
        ready = self._ready.pop(key, None)
        if ready is not None:
            self.held_bytes -= len(ready[1])
            return ready  # delivered before the failure: the op it belongs to can finish
        if self._failed is not None:
            raise self._fresh_failure()
        waiter: asyncio.Future[tuple[p.Data, bytes | bytearray]] = asyncio.get_running_loop().create_future()
        self._waiting[key] = waiter
        try:
            return await waiter
        finally:
            # A failed wait's traceback holds this frame, whose `waiter` holds the
            # exception: a cycle only the collector (rarely run, see _tune_gc) would free,
            # keeping alive the callers' frames and the views of buffers they hold.
            del waiter

    def fail(self, error: CallError) -> None:
        """Wake every wait with `error` (the world failed), and fail later waits for data
        that has not come. Links are FIFO, so what a peer sent before its failure notice
        is already here and stays readable."""
        self._failed = error
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(self._fresh_failure())
        self._waiting.clear()

    def drop_unread(self) -> None:
        """The failed epoch's ops are all over: what they did not take has no reader now."""
        if self._failed is not None:
            self._ready.clear()
            self.held_bytes = 0

    def _fresh_failure(self) -> CallError:
        """A new exception per wait: one shared instance would collect the traceback of
        every raise, whose frames hold views of the ops' buffers, and so keep a failed
        world's memory mapped for as long as this inbox lives."""
        assert self._failed is not None
        return CallError(self._failed.code, self._failed.message)


class WorldNet:
    """One world's view of the cluster: which daemon is the root, who hosts which rank."""

    def __init__(self, cluster: Cluster, world: str, bootstrap: str | None) -> None:
        self.cluster = cluster
        self.world = world
        self.bootstrap = bootstrap
        self.me = cluster.name
        self.root: PeerLink | None = None  # None: this daemon is the root
        self.member_links: dict[str, PeerLink] = {}  # root only: the link each member's votes came on
        self._placement: tuple[str, ...] = ()
        self._ranks_by_daemon: dict[str, tuple[int, ...]] = {}  # in order of their lowest rank
        self.epoch = 0
        self.inbox = self._new_inbox()
        self.root_known = bootstrap is None  # whether `resolve` found the root

    def begin_epoch(self, epoch: int) -> None:
        """The world formed at `epoch`: what other daemons sent for the last one is dropped."""
        self.epoch = epoch
        self.inbox = self._new_inbox()

    def _new_inbox(self) -> Inbox:
        return Inbox(self.cluster.max_held_bytes)

    @property
    def is_root(self) -> bool:
        """(Until the root is known, a daemon takes the votes other daemons send it, as the
        root: they may come before its own dial to the bootstrap address found itself.)"""
        return self.root is None

    async def resolve(self) -> None:
        """Find the root: dial the bootstrap address; if it is our own listener, we are it.
        A link to the root that was lost (a cut network, a restarted root) is dialed anew.
        (Concurrent calls share one dial: the cluster's.)"""
        if self.bootstrap is None or (self.root_known and (self.root is None or not self.root.closed)):
            return
        self.root = await self.cluster.link_to(self.bootstrap)
        self.root_known = True

    def find_root(self, bootstrap: str) -> None:
        """The root is at `bootstrap` (this daemon, or another): the next `resolve` dials it."""
        self.bootstrap = bootstrap
        self.root_known = False

    @property
    def placement(self) -> tuple[str, ...]:
        """Each rank's daemon, as the world formed."""
        return self._placement

    @placement.setter
    def placement(self, placement: tuple[str, ...]) -> None:
        # (worked out once: the ops ask per call, and a world may have thousands of ranks)
        ranks: dict[str, list[int]] = {}
        for rank, daemon in enumerate(placement):
            ranks.setdefault(daemon, []).append(rank)
        self._placement = placement
        self._ranks_by_daemon = {daemon: tuple(of) for daemon, of in ranks.items()}

    def ranks_of(self, daemon: str) -> tuple[int, ...]:
        return self._ranks_by_daemon.get(daemon, ())

    def members(self) -> list[str]:
        """The other daemons of the world, in order of their lowest rank."""
        return [daemon for daemon in self._ranks_by_daemon if daemon != self.me]

    def send(self, daemon: str, msg: p.PeerMessage, payload: bytes | bytearray | memoryview = b"") -> None:
        """To one daemon of the world: the root if we are a member, any member if we are root."""
        link = self.root if self.root is not None else self.member_links.get(daemon)
        if link is None or link.closed:
            raise CallError(ErrorCode.WORLD_FAILED, f"daemon {daemon} of world {self.world} is unreachable")
        link.send(msg, payload)

    async def drain(self) -> None:
        links = [self.root] if self.root is not None else [
            self.member_links[d] for d in self.members() if d in self.member_links]
        for link in links:
            await link.drain()

    def uses(self, link: PeerLink) -> bool:
        """Whether the world's messages go over `link`."""
        return self.root is link if self.root is not None else link in self.member_links.values()


class Router(Protocol):
    """What the cluster hands incoming world messages to (the registry)."""

    def on_peer_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None: ...

    def on_peer_lost(self, link: PeerLink, reason: str) -> None: ...


class Cluster:
    def __init__(self, settings: PeerSettings, max_held_bytes: int = DEFAULT_MAX_HELD_BYTES) -> None:
        self.name = settings.name
        self.settings = settings
        self.max_held_bytes = max_held_bytes  # each world's Inbox limit
        self.links: dict[str, PeerLink] = {}  # by daemon: an open link to it (status, metrics)
        self._siblings: dict[str, list[PeerLink]] = {}  # by daemon: every open link to it
        self._node = PeerNode(settings, self._on_message, self._on_lost, self._name_taken)
        self._dials: dict[str, asyncio.Future[PeerLink | None]] = {}
        self._self_addresses: set[str] = set()
        self.router: Router | None = None
        self.port: int | None = None
        self.stale_refused = 0
        self.foreign_refused = 0  # messages about a world from a daemon that is not one of its
        self.votes_lost_with_links = 0  # votes of members that left the link they came over
        # JoinWorld ids: daemon-wide, so a refusal of a vote for a world since forgotten and
        # made anew by the name cannot match a vote of the new one
        self.vote_ids = itertools.count(1)

    @property
    def refused(self) -> int:
        return self._node.refused

    async def listen(self, host: str, port: int) -> int:
        try:
            self.port = await self._node.listen(host, port, self._adopt)
        except (OSError, UnicodeError) as exc:
            raise cannot_listen("peer_listen", host, port, exc) from None
        log.info("peer port %s:%d, daemon name %s", host, self.port, self.name)
        return self.port

    def _name_taken(self, name: str, incarnation: bytes) -> str | None:
        """Why a daemon called `name`, of process `incarnation`, may not link: another process
        of that name still counts as alive here (two daemons given one peer_name would take
        each other's ranks, and each link of one would end the other's worlds as a restart
        does). A restarted daemon's old process closed its links as it died; one that fell
        silent with its host is lost within the window, and the new one links then. (Not a
        few of our heartbeats: the other daemon beats at its own --peer-heartbeat.)"""
        for old in self._siblings.get(name, []):
            if old.incarnation != incarnation and old.speaks():
                return (f"daemon name {quoted(name)} is taken: another process of that name is linked to "
                        f"daemon {self.name} (heard {old.silence():.1f}s ago; lost once silent "
                        f"{self.settings.window_s:g}s); each daemon needs a peer_name of its own")
        return None

    def _adopt(self, link: PeerLink) -> None:
        """Keep a new link. One from a new process of a known daemon (restarted) ends the
        old process's links, and its worlds; a second one from the same process joins the
        first (each daemon dialed the other, for worlds rooted on either side)."""
        for old in [o for o in self._siblings.get(link.name, []) if o.incarnation != link.incarnation]:
            old.close("replaced: the daemon runs as a new process")
        self._siblings.setdefault(link.name, []).append(link)
        self.links.setdefault(link.name, link)

    async def link_to(self, address: str) -> PeerLink | None:
        """An authenticated link to the daemon at `address` (dialed once), or None if it is us."""
        if address in self._self_addresses:
            return None
        while (pending := self._dials.get(address)) is not None:
            known = await asyncio.shield(pending)
            if known is None or not known.closed:
                return known
            if self._dials.get(address) is pending:
                break  # its link was lost: dial anew (others who waited on it wait on ours)
        future: asyncio.Future[PeerLink | None] = asyncio.get_running_loop().create_future()
        self._dials[address] = future
        link: PeerLink | None
        try:
            host, port = parse_address(address)
            link = await self._node.dial(host, port)
        except SelfDialError:
            self._self_addresses.add(address)
            link = None
        except BaseException as exc:  # whatever went wrong, later dials must not wait on this one
            del self._dials[address]
            why = "the dial was cancelled" if isinstance(exc, asyncio.CancelledError) else \
                str(exc) or type(exc).__name__
            kind = NotListening if isinstance(exc, ConnectionRefusedError) else CallError
            error = kind(ErrorCode.PEER_LOST, f"cannot reach the daemon at {address}: {why}")
            future.set_exception(error)
            future.exception()
            if not isinstance(exc, Exception):
                raise  # cancelled: those who waited on this dial hear why, we stop
            raise future.exception() from None  # type: ignore[misc]
        if link is not None:
            self._adopt(link)
        future.set_result(link)
        return link

    def _on_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None:
        if self.router is not None:
            self.router.on_peer_message(link, msg, payload)

    def _on_lost(self, link: PeerLink, reason: str) -> None:
        """A link is gone: the worlds that used it fail; the daemon's other links live on."""
        siblings = self._siblings.get(link.name, [])
        if link in siblings:
            siblings.remove(link)
        if not siblings:
            self._siblings.pop(link.name, None)
        if self.links.get(link.name) is link:
            if siblings:
                self.links[link.name] = siblings[0]
            else:
                del self.links[link.name]
        for address, future in list(self._dials.items()):
            if future.done() and not future.exception() and future.result() is link:
                del self._dials[address]
        if self.router is not None:
            self.router.on_peer_lost(link, reason)

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "port": self.port,
            "links": sorted(self.links),
            "refused_handshakes": self.refused,
            "stale_refused": self.stale_refused,
            "foreign_refused": self.foreign_refused,
            "votes_lost_with_links": self.votes_lost_with_links,
        }

    def announce_quiet(self, seconds: float) -> None:
        """Tell every linked daemon our loop may stall for up to `seconds` (see
        Engine.on_loop_stall): silence that long is not a lost daemon."""
        for link in self.open_links():
            link.announce_quiet(seconds)

    def open_links(self) -> list[PeerLink]:
        """Every open link, to every daemon (`links` holds one per daemon)."""
        return [link for siblings in self._siblings.values() for link in siblings]

    def close(self) -> None:
        self._node.close()
        for link in self.open_links():
            link.close(_STOPPING)

    async def farewell(self, within: float) -> None:
        """`close` as the daemon stops: each link first sends what is queued on it (`within`
        seconds at most, all links together; see PeerLink.farewell)."""
        self._node.close()
        await asyncio.gather(*(link.farewell(_STOPPING, within) for link in self.open_links()))


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:port`)."""
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise ValueError(f"{address!r} is not HOST:PORT")
    if int(port) > 65535:  # (a dial would take it modulo 65536, another daemon's port perhaps)
        raise ValueError(f"port {int(port)} is not a TCP port")
    if host.startswith("[") or host.endswith("]"):
        if not (len(host) > 2 and host[0] == "[" and host[-1] == "]" and "[" not in host[1:]
                and "]" not in host[:-1]):
            raise ValueError(f"{address!r}: unbalanced brackets around the host")
        return host[1:-1], int(port)
    if ":" in host:  # (which colon ends the host is a guess: ::1:9420 may be [::1:9420]:PORT)
        raise ValueError(f"{address!r}: an IPv6 host goes in brackets, [ADDRESS]:PORT")
    return host, int(port)

