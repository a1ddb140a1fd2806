"""Who decides that a world has formed, and who hears that it failed.

`LocalMembership`: every rank is on this daemon (no bootstrap address); the
world forms when all of them are waiting.

`NetMembership`: the world spans daemons. Each local vote (a hello, or an
attempt_reconnect) goes to the root, the daemon that hosts rank 0. The root
counts votes from every daemon, and when all `world_size` ranks are present it
picks the next epoch and sends every member the placement (which daemon hosts
which rank). Failures travel member → root → every other member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import KeysView
from typing import TYPE_CHECKING, NamedTuple, Protocol

from proto import ErrorCode, ProtoError, codec
from proto import peer as p
from proto.fields import U64_MAX

from .errors import CallError, NotListening, from_peer, rank_list, seconds
from .peering import Backoff
from .tasks import HeldTasks

if TYPE_CHECKING:
    from .cluster import WorldNet
    from .peerlink import PeerLink

log = logging.getLogger("commd.membership")
# A root daemon not listening yet is dialed again after a Backoff of these pauses: daemons
# come up within about a second of each other, and a refused connect costs next to nothing.
ROOT_RETRY_S = (0.05, 1.0)


class Formable(Protocol):
    """What a membership drives in its world."""

    name: str
    world_size: int
    epoch: int

    def form(self, epoch: int, local_ranks: tuple[int, ...], placement: tuple[str, ...],
             engine_id: bytes = b"") -> None: ...

    def engine_id(self) -> bytes: ...

    def refuse(self, rank: int, code: ErrorCode, message: str) -> None: ...

    def fail(self, code: ErrorCode, message: str, propagate: bool = True,
             rank: int | None = None) -> None: ...

    def log_extra(self, rank: int | None = None) -> dict[str, object]: ...

    def local_waiting(self) -> KeysView[int]: ...

    def forget_if_empty(self) -> None: ...


class Arrivals:
    """The ranks that came in the round being formed, for a join timeout's message. A rank
    refused at its timeout counts as come until another rank arrives after it (the ranks a
    round's timeout refuses one by one must each name the same missing ranks; a round that
    went on without it names it), one that left does not. The missing are listed once for
    as long as that holds: a round of thousands timing out asks thousands of times."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._came: set[int] = set()
        self._refused: set[int] = set()
        self._missing: list[int] | None = None

    def arrived(self, rank: int) -> None:
        self._came -= self._refused
        self._refused.clear()
        self._came.add(rank)
        self._missing = None

    def refused(self, rank: int) -> None:
        self._refused.add(rank)

    def left(self, rank: int) -> None:
        self._came.discard(rank)
        self._refused.discard(rank)
        self._missing = None

    def clear(self) -> None:
        self._came.clear()
        self._refused.clear()
        self._missing = None

    def missing(self) -> list[int]:
        if self._missing is None:
            self._missing = [r for r in range(self._world_size) if r not in self._came]
        return self._missing


class LocalMembership:
    def __init__(self, world: Formable) -> None:
        self._world = world
        self._arrivals = Arrivals(world.world_size)

    def vote(self, rank: int, timeout_s: float) -> None:
        self._arrivals.arrived(rank)
        waiting = self._world.local_waiting()
        if len(waiting) == self._world.world_size:
            self._arrivals.clear()
            ranks = tuple(sorted(waiting))
            self._world.form(self._world.epoch + 1, ranks, ("local",) * len(ranks))

    def withdraw(self, rank: int, left: bool = True) -> None:
        """`left`: the rank went away (not refused), so it is missing again."""
        if left:
            self._arrivals.left(rank)
        else:
            self._arrivals.refused(rank)
        if not self._world.local_waiting():  # the round is over
            self._arrivals.clear()

    def voting(self) -> bool:
        return False

    def votes_held(self) -> int:
        return 0

    def missing(self) -> list[int]:
        return self._arrivals.missing()

    def failed(self, code: ErrorCode, message: str) -> None:
        pass

    def peer_lost(self, link: PeerLink) -> None:
        pass


def _ms(seconds: float) -> int:
    """Milliseconds for a peer message's u64: a timeout at the top of the hello's u64 comes
    back from seconds (a float) rounded past it."""
    return min(U64_MAX, int(seconds * 1000))


class Due(NamedTuple):
    """When a rank's vote's time is up (loop time), and the whole time it was given: a vote
    cast again over a new link keeps the rank's own deadline, not a fresh one."""

    at: float
    whole_s: float


class Ballot(NamedTuple):
    """A member's vote, as the root holds it."""

    link: PeerLink  # where the vote came, and its refusal goes
    vote: int  # the member's id for it (JoinWorld.vote), echoed in JoinRefused


class NetMembership:
    def __init__(self, world: Formable, net: WorldNet, token: str | None) -> None:
        self._world = world
        self.net = net
        self._token = token
        self._votes: dict[int, str] = {}  # root only: rank -> daemon, for the epoch being formed
        self._ballots: dict[int, Ballot] = {}  # root only: a member's vote: its link and id
        self._sent: dict[int, int] = {}  # member only: rank -> the id of its vote at the root
        # rank -> the id of its newest vote, until cast. A vote still looking for the root is
        # the rank's no more once a newer one came: its process left and a new one took the
        # rank number, or it called attempt_reconnect again; the older vote must not speak for it.
        self._casting: dict[int, int] = {}
        self._due: dict[int, Due] = {}  # rank -> its newest vote's
        self._voting = HeldTasks()
        # the votes dialing a root not listening yet: the first says so in the log, for all
        # (8 ranks of a node said it 8 times)
        self._dialing: set[int] = set()
        self._timers: dict[int, asyncio.TimerHandle] = {}  # root only: votes' deadlines
        self._arrivals = Arrivals(world.world_size)  # root only: ranks seen in the round being formed
        # root only: the newest epoch a vote of this round was cast at. A fresh process for
        # rank 0 starts the world here at epoch 0 while the members' ranks reconnect at theirs:
        # the new epoch must be newer than every daemon's, or they drop it as stale.
        self._round_epoch = 0

    # ---- local ranks --------------------------------------------------------------

    def vote(self, rank: int, timeout_s: float) -> None:
        self._cast(rank, Due(asyncio.get_running_loop().time() + timeout_s, timeout_s))

    def _cast(self, rank: int, due: Due) -> None:
        vote = next(self.net.cluster.vote_ids)
        self._casting[rank] = vote
        self._due[rank] = due
        self._voting.spawn(self._vote(rank, vote, due))

    def _still_casting(self, rank: int, vote: int) -> bool:
        """Whether `vote` is still the rank's, and the rank still waits."""
        return self._casting.get(rank) == vote and rank in self._world.local_waiting()

    async def _vote(self, rank: int, vote: int, due: Due) -> None:
        try:
            await self._find_root(rank, vote, due)
        except CallError as exc:
            if self._still_casting(rank, vote):
                self._world.refuse(rank, exc.code, f"world {self._world.name}: {exc.message}")
            return
        if not self.net.is_root and self._votes:
            # other daemons' votes, counted while we might have been the root: they were sent
            # to the wrong daemon (theirs was told another bootstrap address than ours)
            self._refuse_all(f"daemon {self.net.me} is not the root of world {self._world.name}; "
                             f"its root is the daemon at {self.net.bootstrap}")
        if not self._still_casting(rank, vote):
            return  # gone (or voting anew) while we looked for the root
        del self._casting[rank]
        # (the root gets the time left, not the whole: dialing it took some; its deadline
        # for the vote is the rank's, or a member's backstop fires first, naming no rank)
        left = max(0.0, due.at - asyncio.get_running_loop().time())
        if self.net.is_root:
            holder = self._votes.get(rank)
            if holder is not None and holder != self.net.me:  # first come, as in remote_vote
                self._world.refuse(rank, ErrorCode.DUPLICATE_RANK, f"rank {rank} of world "
                                   f"{self._world.name} is already on daemon {holder}")
                return
            self._deadline(rank, left, None, due.whole_s)
            self._count(rank, self.net.me)
            return
        try:
            self.net.send("root", p.JoinWorld(self._world.name, self._world.world_size, rank,
                                              self._world.epoch, max(1, _ms(left)), self._token,
                                              vote, _ms(due.whole_s)))
            self._sent[rank] = vote
        except CallError as exc:  # the link went down between resolving and sending
            self._world.refuse(rank, ErrorCode.PEER_LOST, f"world {self._world.name}: {exc.message}")

    async def _find_root(self, rank: int, vote: int, due: Due) -> None:
        """Resolve the root. One whose address nothing listens at yet (its daemon starts after
        ours, or restarts) is dialed again until the rank's timeout: daemons of one job start
        in no set order. Any other failure to reach it refuses the rank at once."""
        try:
            await self._dial_root(rank, vote, due)
        finally:
            self._dialing.discard(vote)

    async def _dial_root(self, rank: int, vote: int, due: Due) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(*ROOT_RETRY_S)
        while True:
            try:
                await self.net.resolve()
                return
            except NotListening as exc:
                if not self._still_casting(rank, vote):
                    return  # the rank left, or voted anew: this vote waits for the root no more
                left = due.at - loop.time()
                if left <= 0:
                    raise CallError(ErrorCode.TIMEOUT, f"{exc.message} (dialed {backoff.tries} times in "
                                                       f"{due.whole_s:g}s; is its daemon running?)"
                                                       f"{self._root_gone()}") from None
                if backoff.tries == 1 and not self._dialing:
                    log.info("world %s: %s; dialing again for up to %s", self._world.name, exc.message,
                             seconds(left), extra=self._world.log_extra(rank))
                self._dialing.add(vote)
                # (the last pause ends at the deadline, with one more try: giving up when the next
                # pause would pass it gave up as much as a whole pause, up to 1 s, early)
                await asyncio.sleep(min(backoff.pause(), left))

    def _root_gone(self) -> str:
        """What became of our last link to the root, if we had one: a root that was there and
        went (stopped for good, or its host is down) reads otherwise the same as one that
        never started, and its loss was said only in this daemon's log."""
        root = self.net.root
        if root is None or not root.closed:
            return ""
        return f"; the link to it closed {time.monotonic() - root.closed_at:.1f}s before: {root.loss}"

    def withdraw(self, rank: int, left: bool = True) -> None:
        """A local rank that voted is gone (`left`) or was refused: its vote goes too."""
        self._casting.pop(rank, None)
        self._due.pop(rank, None)
        if self.net.is_root:
            if self._votes.get(rank) == self.net.me:
                self._forget_vote(rank, left=left)
        elif self._sent.pop(rank, None) is not None and self.net.root is not None:
            with contextlib.suppress(CallError):  # a root that is gone counts no votes
                self.net.send("root", p.JoinWithdrawn(self._world.name, rank))

    def refused(self, msg: p.JoinRefused, root: str) -> None:
        """The root (`root`, its daemon) refused a vote (member only). One it refused as the
        rank's withdrawal crossed the refusal is no longer the rank's vote: the rank may have
        voted again."""
        if self._sent.get(msg.rank) == msg.vote:
            self._world.refuse(msg.rank, *from_peer(root, msg.code, msg.message))

    def voting(self) -> bool:
        """Whether the root holds votes: a world with no rank here yet is not empty then."""
        return bool(self._votes)

    def votes_held(self) -> int:
        """How many ranks' votes the root holds for the epoch being formed (its own ranks'
        too, which a task counts after their hello): the status shows no other trace of a
        member's rank before the world forms."""
        return len(self._votes)

    def missing(self) -> list[int]:
        """Ranks that never arrived in this round (only the root knows; members say so, and
        so does a member still looking for its root: it has counted nobody)."""
        return self._not_arrived() if self.net.is_root and self.net.root_known else []

    def _not_arrived(self) -> list[int]:
        return self._arrivals.missing()

    # ---- the root's side ----------------------------------------------------------

    def remote_vote(self, link: PeerLink, msg: p.JoinWorld) -> None:
        """A member's rank is here (root only); the caller checked size and token."""
        holder = self._votes.get(msg.rank)
        if holder is not None and holder != link.name:
            link.send(p.JoinRefused(self._world.name, msg.rank, ErrorCode.DUPLICATE_RANK,
                                    f"rank {msg.rank} of world {self._world.name} is already on "
                                    f"daemon {holder}", msg.vote))
            return
        moved_off = self.net.member_links.get(link.name)
        if moved_off is not None and moved_off is not link:
            # A member reaches the root over one link per world: it left the one its earlier
            # votes came on (lost on its side, which refused those ranks there; their
            # withdrawals could not come, and we may not have seen that link end yet)
            self._forget_votes_over(moved_off)
        self._deadline(msg.rank, msg.timeout_ms / 1000, link, (msg.whole_ms or msg.timeout_ms) / 1000)
        self.net.member_links[link.name] = link  # where the world answers that daemon
        self._ballots[msg.rank] = Ballot(link, msg.vote)
        self._round_epoch = max(self._round_epoch, msg.epoch)
        self._count(msg.rank, link.name)

    def remote_withdraw(self, link: PeerLink, rank: int) -> None:
        """A member's rank went away before the world formed (root only)."""
        if self._votes.get(rank) == link.name:
            self._forget_vote(rank, left=True)
            self._world.forget_if_empty()

    def _forget_votes_over(self, link: PeerLink) -> None:
        """The votes that came over `link`, which their member no longer uses, go (it casts
        them again over its new link); counted daemon-wide, as their world may be forgotten."""
        lost = self._votes_over(link)
        for rank in lost:
            self._forget_vote(rank, left=True)
        self.net.cluster.votes_lost_with_links += len(lost)

    def _votes_over(self, link: PeerLink) -> list[int]:
        return [rank for rank, ballot in self._ballots.items() if ballot.link is link]

    def _forget_vote(self, rank: int, left: bool = False) -> None:
        """`left`: the rank went away (it is named among the missing if the round times out;
        one whose vote timed out did arrive)."""
        del self._votes[rank]
        if left:
            self._arrivals.left(rank)
        else:
            self._arrivals.refused(rank)
        self._ballots.pop(rank, None)
        timer = self._timers.pop(rank, None)
        if timer is not None:
            timer.cancel()
        if not self._votes:
            self._end_round()

    def _end_round(self) -> None:
        """The round is over (formed, or every vote withdrawn): the next one counts afresh."""
        self._votes.clear()
        self._ballots.clear()
        self._arrivals.clear()
        self._round_epoch = 0
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _deadline(self, rank: int, left_s: float, link: PeerLink | None, whole_s: float) -> None:
        """The root times every vote out itself, local or remote, so it can name the
        ranks that never came (a member's own timer is only a backstop): at the rank's
        deadline, `left_s` from now; the refusal names the rank's whole timeout."""
        old = self._timers.pop(rank, None)
        if old is not None:
            old.cancel()
        self._timers[rank] = asyncio.get_running_loop().call_later(
            left_s, self._expire, rank, link, whole_s)

    def _expire(self, rank: int, link: PeerLink | None, timeout_s: float) -> None:
        daemon = self.net.me if link is None else link.name
        if self._votes.get(rank) != daemon:
            return
        # (votes are counted as the root, also by a daemon still dialing its bootstrap address)
        message = (f"world {self._world.name}: ranks {rank_list(self._not_arrived())} did not arrive "
                   f"within {seconds(timeout_s)}")
        self._drop_vote(rank, ErrorCode.TIMEOUT, message)

    def _drop_vote(self, rank: int, code: ErrorCode, message: str) -> None:
        """Refuse a vote: a member's over the link it came on, ours here."""
        ballot = self._ballots.get(rank)
        self._forget_vote(rank)
        if ballot is None:
            self._world.refuse(rank, code, message)
        else:
            ballot.link.send(p.JoinRefused(self._world.name, rank, code, message, ballot.vote))
        self._world.forget_if_empty()  # (a root's world made for a member's vote, say)

    def _count(self, rank: int, daemon: str) -> None:
        self._votes[rank] = daemon
        self._arrivals.arrived(rank)
        if len(self._votes) < self._world.world_size:
            return
        placement = tuple(self._votes[r] for r in range(self._world.world_size))
        if placement[0] != self.net.me:
            self._refuse_all(f"the bootstrap address must be the peer port of the daemon that hosts "
                             f"rank 0; that is daemon {placement[0]}, not {self.net.me}")
            return
        epoch = max(self._world.epoch, self._round_epoch) + 1
        try:
            ready = p.WorldReady(self._world.name, epoch, placement, self._world.engine_id())
            codec.encode_peer(ready)
        except ProtoError as exc:  # a placement too big for one frame (thousands of ranks)
            # (a limit the job can get under, not a misuse: the names are what take the room)
            longest = max(len(daemon) for daemon in placement)
            self._refuse_all(f"world {self._world.name} cannot be announced to its daemons: its placement of "
                             f"{len(placement)} ranks by daemon names of up to {longest} characters does not "
                             f"fit one peer message ({exc}); shorter daemon names (--peer-name) fit more "
                             "ranks", ErrorCode.LIMIT)
            return
        except CallError as exc:  # the engine could not make the communicators' id
            self._refuse_all(f"world {self._world.name}: {exc.message}", exc.code)
            return
        self._end_round()
        self.net.placement = placement
        self.net.member_links = {d: link for d, link in self.net.member_links.items() if d in placement}
        for daemon in self.net.members():
            try:
                self.net.send(daemon, ready)
            except CallError as exc:
                log.warning("world %s: %s", self._world.name, exc.message, extra=self._world.log_extra())
        self._world.form(epoch, self.net.ranks_of(self.net.me), placement, ready.engine_id)

    def _refuse_all(self, message: str, code: ErrorCode = ErrorCode.WORLD_CONFLICT) -> None:
        for rank, daemon in list(self._votes.items()):
            if daemon == self.net.me or rank in self._ballots:
                self._drop_vote(rank, code, message)
            else:
                self._forget_vote(rank)
        self._world.forget_if_empty()

    # ---- messages from the root (members) or to it ----------------------------------

    def ready(self, msg: p.WorldReady, root: str, running: bool = False) -> None:
        """The root's word (`root`, its daemon) that the world formed (member only).
        `running`: the world runs an epoch here, so none of our ranks voted for this one."""
        misfit = (f"it places {len(msg.placement)} ranks" if len(msg.placement) != self._world.world_size
                  else f"it places rank 0 on daemon {msg.placement[0]}" if msg.placement[0] != root
                  else f"daemon {self.net.me}'s ranks run epoch {self._world.epoch} and voted for no other"
                  if running else None)
        if misfit is not None:  # a root that lost track (else every lookup by rank goes wrong here)
            message = (f"world {self._world.name} of {self._world.world_size} ranks cannot form as the "
                       f"root daemon {root} says: {misfit}")
            with contextlib.suppress(CallError):
                self.net.send("root", p.WorldFailed(self._world.name, msg.epoch, ErrorCode.WORLD_FAILED,
                                                    message))
            for rank in sorted(self._world.local_waiting()):
                self._world.refuse(rank, ErrorCode.WORLD_FAILED, message)
            # (the running epoch's ops wait on data the root now sends to another epoch: they
            # must hear it; the root heard already, of the epoch it believes in)
            self._world.fail(ErrorCode.WORLD_FAILED, message, propagate=False)
            return
        self.net.placement = msg.placement
        local = self.net.ranks_of(self.net.me)
        gone = sorted(set(local).difference(self._world.local_waiting()))
        self._world.form(msg.epoch, local, msg.placement, msg.engine_id)
        if gone:  # they left while it formed (their withdrawal crossed this): it cannot run
            self._world.fail(ErrorCode.WORLD_FAILED, f"world {self._world.name}: ranks "
                             f"{rank_list(gone)} left before it formed")

    def failed(self, code: ErrorCode, message: str) -> None:
        """The world failed here: tell the root, or (as root) every member."""
        msg = p.WorldFailed(self._world.name, self._world.epoch, code, message)
        targets = self.net.members() if self.net.is_root else ["root"]
        for daemon in targets:
            with contextlib.suppress(CallError):  # a daemon that is gone fails the world by itself
                self.net.send(daemon, msg)

    def peer_lost(self, link: PeerLink) -> None:
        """`link` is gone: if the world used it, the world fails (as `link.loss` says), and the
        votes cast over it go (a member that dialed the root anew votes over its new link)."""
        if not self.net.uses(link) and not self._votes_over(link):
            return
        message = link.loss
        if self.net.is_root:
            if self.net.member_links.get(link.name) is link:
                del self.net.member_links[link.name]
            self._forget_votes_over(link)
        else:
            # Our votes went with the link. The root may be restarting (systemd's restart, or a
            # SIGTERM and a new process), which a new dial waits for as for a root not up yet:
            # each vote is cast again within its rank's own time; one whose time is up is refused.
            now = asyncio.get_running_loop().time()
            for rank in sorted(self._world.local_waiting()):
                if rank in self._casting:
                    continue  # (still looking for the root: its dial finds the link closed)
                due = self._due.get(rank)
                if self._sent.pop(rank, None) is not None and due is not None and due.at > now:
                    self._cast(rank, due)
                else:
                    self._world.refuse(rank, link.loss_code,
                                       f"world {self._world.name}: the root {message}")
        self._world.fail(link.loss_code, message)
        self._world.forget_if_empty()
