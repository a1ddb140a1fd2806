"""All worlds of one daemon, by name, and the routing of what other daemons say about them.

A world is created by its first hello (or, on a world's root, by the first
member daemon that reports a rank of it) and dropped when its last rank leaves.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
from collections.abc import Callable
from typing import Any

import proto
from proto import ErrorCode
from proto import peer as p

from .cluster import Cluster, WorldNet, parse_address
from .engine.base import Engine
from .engine.crosscheck import p2p_target, sender_rank
from .errors import CallError, from_peer
from .logs import Throttled
from .membership import NetMembership
from .oprunner import ABORT_GRACE_S
from .peerlink import PeerLink
from .stats import DaemonStats
from .sweep import WorldSweep
from .tickets import Peer
from .world import World, WorldState

log = logging.getLogger("commd.registry")


class Registry:
    def __init__(self, engine: Engine, max_pending_ops: int = 4096,
                 cluster: Cluster | None = None, stats: DaemonStats | None = None,
                 max_forming_worlds: int = 1024, max_call_timeout_s: float | None = None) -> None:
        self._engine = engine
        self._max_call_timeout_s = max_call_timeout_s
        self.stats = stats if stats is not None else DaemonStats()
        self._max_pending_ops = max_pending_ops
        self._max_forming_worlds = max_forming_worlds
        self.cluster = cluster
        self.worlds: dict[str, World] = {}
        self._sweep = WorldSweep(ABORT_GRACE_S + 1.0)
        # (a confused or hostile daemon may send such messages without end; the cluster counts each)
        self._foreign_log = Throttled(log)
        self._stale_log = Throttled(log)
        self._ask_log = Throttled(log)
        if cluster is not None:
            cluster.router = self
        self._on_peer: dict[type, Callable[[PeerLink, Any, bytes | bytearray], None]] = {
            p.JoinWorld: self._remote_join,
            p.JoinRefused: self._join_refused,
            p.JoinWithdrawn: self._join_withdrawn,
            p.WorldReady: self._world_ready,
            p.WorldFailed: self._world_failed,
            p.CallsQuery: self._calls_query,
            p.CallsReport: self._calls_report,
            p.Data: self._data,
        }

    # ---- local ranks ------------------------------------------------------------------

    def join(self, peer: Peer, hello: proto.Hello) -> World:
        """Admit `hello` into its world (creating it), or raise CallError saying why not."""
        if hello.bootstrap is not None:
            _readable_bootstrap(hello.bootstrap)
        world = self.worlds.get(hello.world)
        if world is not None:
            self._admissible(world, hello.world_size, hello.token, hello.rank)
            # freeing the rank may have ended the world (its hung-up holder was the last rank
            # there): this hello then starts the new one, which the other ranks find by name
            world = self.worlds.get(hello.world)
        if world is None:
            world = self._create(hello.world, hello.world_size, hello.token, hello.bootstrap,
                                 call_timeout_s=hello.timeout_ms / 1000)
        if (world.net is None) != (hello.bootstrap is None):
            raise CallError(ErrorCode.WORLD_CONFLICT,
                            f"world {hello.world} is {'not ' if world.net is None else ''}spread over "
                            "daemons here; every rank must give (or omit) the bootstrap address")
        if world.net is not None and world.net.bootstrap is None and hello.bootstrap is not None:
            # made for other daemons' votes, which took us for the root: our own rank names
            # the root, and it may be another daemon (then those votes are refused, saying so)
            world.net.find_root(hello.bootstrap)
        if world.state is WorldState.READY and world.net is not None \
                and world.net.placement[hello.rank] != world.net.me:
            # a healthy world's rank lives on another daemon: a stray process, not a rebuild
            # (which follows a failure), and its vote would fail the world for everyone
            raise CallError(ErrorCode.DUPLICATE_RANK, f"rank {hello.rank} of world {hello.world} is "
                                                      f"already on daemon {world.net.placement[hello.rank]}")
        world.join(peer, hello)
        return world

    def _create(self, name: str, world_size: int, token: str | None, bootstrap: str | None,
                as_root: bool = False, call_timeout_s: float | None = None) -> World:
        if self._max_call_timeout_s is not None:  # (the operator's say over the ranks')
            call_timeout_s = min(call_timeout_s or math.inf, self._max_call_timeout_s)
        net = None
        if bootstrap is not None or as_root:
            if self.cluster is None:
                raise CallError(ErrorCode.MISUSE, "this daemon has no peer secret configured, so it "
                                                  "cannot take part in a world spread over daemons")
            net = WorldNet(self.cluster, name, bootstrap)
        world = World(name, world_size, token, self._engine, self._forget, net, self._max_pending_ops,
                      call_timeout_s, stats=self.stats)
        self.worlds[name] = world
        return world

    @classmethod
    def _admissible(cls, world: World, world_size: int, token: str | None, rank: int) -> None:
        cls._same_world(world, world_size, token)
        world.free_if_hung_up(rank)
        if world.holds(rank):
            raise CallError(ErrorCode.DUPLICATE_RANK,
                            f"rank {rank} of world {world.name} is already connected")

    @staticmethod
    def _same_world(world: World, world_size: int, token: str | None) -> None:
        """A join names this world: its size, and its token (compared in constant time)."""
        if world.world_size != world_size:
            raise CallError(ErrorCode.WORLD_CONFLICT,
                            f"world {world.name} has {world.world_size} ranks, "
                            f"hello says world_size={world_size}")
        if not hmac.compare_digest((world.token or "").encode(), (token or "").encode()):
            raise CallError(ErrorCode.PERMISSION, f"wrong join token for world {world.name}")

    def _forget(self, world: World) -> None:
        if self.worlds.get(world.name) is world:
            del self.worlds[world.name]
            self.stats.forget(world.name)
            self._sweep.world_forgotten()

    # ---- other daemons ------------------------------------------------------------------

    def on_peer_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None:
        # (the link takes no handshake message after the handshake, and keeps heartbeats: a
        # type with no handler here is this daemon's bug, which the link says is its own)
        self._on_peer[type(msg)](link, msg, payload)

    def on_peer_lost(self, link: PeerLink, reason: str) -> None:
        for world in list(self.worlds.values()):
            if isinstance(world.membership, NetMembership):
                try:
                    world.membership.peer_lost(link)
                except Exception:  # one world's bug must not keep the others from hearing it
                    log.exception("world %s: handling the loss of a link to %s failed", world.name, link.name,
                                  extra=world.log_extra())

    def _remote_join(self, link: PeerLink, msg: p.JoinWorld, payload: bytes | bytearray) -> None:
        """A member reports one of its ranks (we are, or should be, the world's root)."""
        world = self.worlds.get(msg.world)
        try:
            if msg.epoch > p.MAX_VOTE_EPOCH:
                raise CallError(ErrorCode.BAD_MESSAGE, f"rank {msg.rank}'s vote for world {msg.world} "
                                                       f"names epoch {msg.epoch}, past any world's "
                                                       f"({p.MAX_VOTE_EPOCH})")
            if world is None:
                self._may_form_for_others()
                world = self._create(msg.world, msg.world_size, msg.token, None, as_root=True,
                                     call_timeout_s=msg.timeout_ms / 1000)
            if world.net is None or not world.net.is_root:
                raise CallError(ErrorCode.WORLD_CONFLICT,
                                f"daemon {self._name()} is not the root of world {msg.world}")
            self._same_world(world, msg.world_size, msg.token)
        except CallError as exc:
            link.send(p.JoinRefused(msg.world, msg.rank, exc.code, exc.message, msg.vote))
            return
        if world.state is WorldState.READY and (msg.epoch != world.epoch
                                                or not self._in_world(world, link, any_link=True)
                                                or world.net.placement[msg.rank] != link.name):
            # a hello for a rank of a full, healthy world: someone else's process, not a rebuild
            # (a rebuild's vote comes from the daemon the rank was on, at the world's epoch)
            link.send(p.JoinRefused(msg.world, msg.rank, ErrorCode.DUPLICATE_RANK,
                                    f"world {msg.world} is ready with all its ranks; rank {msg.rank} "
                                    "is taken", msg.vote))
            return
        world.reconnect_requested(f"rank {msg.rank} (on daemon {link.name}) called attempt_reconnect")
        assert isinstance(world.membership, NetMembership)
        world.membership.remote_vote(link, msg)

    def _may_form_for_others(self) -> None:
        """Bound the worlds held here for other daemons' votes alone (rank 0 not here yet):
        each lives as long as its vote, and a daemon that holds the secret could make them
        without end, each taking memory and a name real jobs would then find taken."""
        forming = sum(1 for world in self.worlds.values() if world.state is WorldState.FORMING
                      and not world.members and not world.local_waiting())
        if forming >= self._max_forming_worlds:
            raise CallError(ErrorCode.LIMIT, f"daemon {self._name()} holds {forming} forming worlds with "
                                             f"no rank here yet; the limit (max_forming_worlds) is "
                                             f"{self._max_forming_worlds}")

    def _join_refused(self, link: PeerLink, msg: p.JoinRefused, payload: bytes | bytearray) -> None:
        world = self.worlds.get(msg.world)
        if world is not None and isinstance(world.membership, NetMembership) and world.net is not None \
                and world.net.root is link:
            world.membership.refused(msg, link.name)

    def _join_withdrawn(self, link: PeerLink, msg: p.JoinWithdrawn, payload: bytes | bytearray) -> None:
        world = self.worlds.get(msg.world)
        if world is not None and isinstance(world.membership, NetMembership) and world.net is not None \
                and world.net.is_root:
            world.membership.remote_withdraw(link, msg.rank)

    def _world_ready(self, link: PeerLink, msg: p.WorldReady, payload: bytes | bytearray) -> None:
        world = self.worlds.get(msg.world)
        if world is None or not isinstance(world.membership, NetMembership) or world.net is None \
                or world.net.root is not link:
            # Our ranks left while it formed (their withdrawal crossed this); a world here by the
            # name, if any, is a new one (its ranks' votes went, or go, over another link, or
            # it is no member of that daemon's): the root's ranks must not wait on ours until
            # their timeout.
            if world is not None:
                log.warning("daemon %s says world %s is ready, but it is not its root here",
                            link.name, msg.world, extra=world.log_extra())
            link.send(p.WorldFailed(msg.world, msg.epoch, ErrorCode.WORLD_FAILED, f"daemon {self._name()}'s "
                                    f"ranks of world {msg.world} left before it formed"))
            return
        if msg.epoch <= world.epoch:
            self._stale(link, msg.world, msg.epoch, world.epoch)
            return
        world.membership.ready(msg, link.name, running=world.state is WorldState.READY)

    def _world_failed(self, link: PeerLink, msg: p.WorldFailed, payload: bytes | bytearray) -> None:
        world = self.worlds.get(msg.world)
        if world is None or world.net is None:
            return
        if msg.epoch < world.epoch:
            self._stale(link, msg.world, msg.epoch, world.epoch)
            return
        if not self._in_world(world, link):
            return
        # The root passes a member's failure on to every member; a member only applies it.
        world.fail(*from_peer(link.name, msg.code, msg.message), propagate=world.net.is_root)

    def _data(self, link: PeerLink, msg: p.Data, payload: bytes | bytearray) -> None:
        world = self.worlds.get(msg.world)
        if world is None or world.net is None or world.state is not WorldState.READY:
            return  # a world that failed or ended here: its data has no reader
        if msg.epoch != world.epoch:
            self._stale(link, msg.world, msg.epoch, world.epoch)
            return
        target = p2p_target(msg)
        if not self._in_world(world, link) or (target is not None and target >= world.world_size):
            return
        if world.net.is_root and not self._sent_by_its_rank(world, link, msg):
            return
        if target is not None and world.net.is_root and world.net.placement[target] != world.net.me:
            try:
                world.net.send(world.net.placement[target], msg, payload)  # relay member -> member
            except CallError as exc:
                world.fail(exc.code, exc.message)
            return
        try:
            world.net.inbox.deliver(msg, payload)
        except CallError as exc:
            world.fail(exc.code, f"world {world.name}: data from daemon {link.name}: {exc.message}")

    def _calls_query(self, link: PeerLink, msg: p.CallsQuery, payload: bytes | bytearray) -> None:
        """Another daemon's watchdog asks for our ranks' newest calls (see Watchdog.report)."""
        world = self._at_epoch(link, msg.world, msg.epoch)
        if world is None or world.net is None:
            return
        if msg.asker != link.name and (world.net.is_root or not world.net.ranks_of(msg.asker)):
            return  # (a member asks for itself only; the root passes on members' questions)
        report = world.watchdog.report(msg)
        if report is None:
            self._ask_log.warning("ignored a calls query of world %s from daemon %s: it asked moments "
                                  "ago", world.name, msg.asker, extra=world.log_extra())
            return
        if world.net.is_root:
            for daemon in world.net.members():
                if daemon != link.name:
                    with contextlib.suppress(CallError):  # (gone: the asker hears it did not answer)
                        world.net.send(daemon, msg)
        link.send(report)

    def _calls_report(self, link: PeerLink, msg: p.CallsReport, payload: bytes | bytearray) -> None:
        world = self._at_epoch(link, msg.world, msg.epoch)
        if world is None or world.net is None:
            return
        net = world.net
        if net.is_root:
            if msg.daemon != link.name:  # a member speaks for its own ranks only
                return
            if msg.asker != net.me:  # a member's answer to another member's query, which we passed on
                if msg.asker != link.name and net.ranks_of(msg.asker):
                    with contextlib.suppress(CallError):
                        net.send(msg.asker, msg)
                return
        if msg.asker == net.me:
            world.watchdog.reported(msg)

    def _at_epoch(self, link: PeerLink, name: str, epoch: int) -> World | None:
        """The world a message is about, if `link` is one of its and the epoch its own."""
        world = self.worlds.get(name)
        if world is None or world.net is None:
            return None
        if epoch != world.epoch:
            self._stale(link, name, epoch, world.epoch)
            return None
        return world if self._in_world(world, link) else None

    @staticmethod
    def _sent_by_its_rank(world: World, link: PeerLink, msg: p.Data) -> bool:
        """(Root) A member speaks for its own ranks only: a frame in another daemon's name
        would be read (or relayed) as that daemon's data. It fails the world."""
        assert world.net is not None
        rank = sender_rank(msg)
        if rank is not None and rank < world.world_size and world.net.placement[rank] == link.name:
            return True
        # (a step no member sends, the root's own "down" say, names no rank: "for rank None" told
        # the operator nothing of what was wrong)
        whose = ", which a member never sends the root" if rank is None else \
            f" for rank {rank}, which is not one of its"
        world.fail(ErrorCode.WORLD_FAILED, f"world {world.name}: daemon {link.name} sent {msg.step!r} data "
                                           f"of call {msg.call}{whose}")
        return False

    def _in_world(self, world: World, link: PeerLink, any_link: bool = False) -> bool:
        """Whether `link` is one the world uses (to its root, or to a member), or with
        `any_link` whether it leads to one of the world's daemons (a member that dialed the
        root anew votes over its new link). Others' word about the world is ignored."""
        assert self.cluster is not None and world.net is not None
        known = link.name in world.net.placement if any_link else world.net.uses(link)
        if not known:
            self.cluster.foreign_refused += 1
            self._foreign_log.warning("ignored a message about world %s from daemon %s, which is not one of "
                                      "its", world.name, link.name, extra=world.log_extra())
        return known

    def _stale(self, link: PeerLink, world: str, epoch: int, current: int) -> None:
        assert self.cluster is not None
        self.cluster.stale_refused += 1
        self._stale_log.warning("refused a message of world %s epoch %d from daemon %s: the world is at "
                                "epoch %d", world, epoch, link.name, current,
                                extra={"world": world, "epoch": current})

    def _name(self) -> str:
        return self.cluster.name if self.cluster is not None else "?"

    # ---- the daemon as a whole ---------------------------------------------------------

    def shutdown(self, message: str) -> None:
        for world in list(self.worlds.values()):
            try:
                world.shutdown(message)
            except Exception:  # one world's bug must not keep the others from hearing it
                log.exception("world %s: shutdown failed", world.name, extra=world.log_extra())
        self._sweep.close()

    def status(self, world: str | None = None) -> list[dict[str, object]]:
        """Every world's status, or only `world`'s (none if unknown): the one asked for
        alone costs no more with hundreds of other worlds here, each with its calls."""
        if world is None:
            shown = list(self.worlds.values())
        else:
            shown = [self.worlds[world]] if world in self.worlds else []
        return [{**w.status(), "local_ranks": list(w.local_ranks),
                 "last_failure": self.stats.last_failure.get(w.name)} for w in shown]

    def connected_ranks(self) -> int:
        return sum(len(w.members) for w in self.worlds.values())


def _readable_bootstrap(address: str) -> None:
    """Refuse a bootstrap address that does not read as HOST:PORT (a typo) as the rank's
    misuse: the world it would make could only fail to dial, and the rank would hear
    PeerLost, a failure that asks for a rebuild, which would fail the same way."""
    try:
        parse_address(address)
    except ValueError as exc:
        raise CallError(ErrorCode.MISUSE, "the bootstrap address is not the root daemon's peer "
                                          f"HOST:PORT: {exc}") from None
