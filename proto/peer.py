"""Messages between daemons (sans-IO); `peerframe` frames and seals them on TCP.

Every link starts with a mutual HMAC challenge-response on a shared secret:

    dialer: PeerHello(name_d, incarnation_d, nonce_d) ──▶ listener
    listener: PeerChallenge(name_l, incarnation_l, nonce_l, HMAC(secret, "listener" | T)) ──▶
    dialer checks it; PeerProof(HMAC(secret, "dialer" | T)) ──▶
    listener checks it; PeerReady ──▶     (or PeerRefused and close, on either side)

A listener with too many handshakes under way answers a connection PeerBusy before it
reads the hello (or, past its hard limit, closes it without a word): the dialer dials
again after a pause, within its handshake timeout.

T (`transcript`) holds the version and both names, incarnations and nonces: a proof
vouches for the identities it was made for, and no field can be swapped. Every
frame after the handshake is sealed (`peerframe.FrameSeal`), under keys derived
from the secret and T. Someone who relays a handshake between two daemons
learns no key: they can pass frames on or drop them, not read, forge, change,
replay or reorder one (they see the handshake and each frame's lengths). A
daemon's incarnation is random per process: two links from one process to
another are both kept (each daemon dialed the other, for worlds rooted on either
side), while a link from a new process of the same name replaces those of the
old one.

Messages about a world carry its epoch; a daemon refuses those of an older epoch.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from .errors import ErrorCode, InvalidMessage
from .fields import (  # one definition of each rule for both protocols
    MAX_HELLO_EPOCH,
    MAX_RANKS,
    MAX_WORLD_NAME,
    U64_MAX,
    check_short_text,
    check_u64,
    clip_text,
    error_code,
)

PEER_VERSION = 9  # 2: incarnations, transcript; 3: signed frames; 4: flow control; 5: sealed; 6: quiet;
#                  7: vote ids; 8: goodbye, a vote's whole timeout, 1 MiB sealed headers, calls queries;
#                  9: the add path's agreement (data steps add-ready, add-propose, add-from)
NONCE_BYTES = 32
INCARNATION_BYTES = 16
MAX_ENGINE_ID = 256  # NCCL's unique id is 128 bytes
MAX_DAEMON_NAME = 256  # characters of a daemon's name (peer_name)
# The newest epoch a root takes a vote at: a hello's, and as many rebuilds again. The root goes
# on from the newest vote's, so one past this would leave no room in the u64 for rebuilds.
MAX_VOTE_EPOCH = 2 * MAX_HELLO_EPOCH


def _name(name: str, value: str, limit: int = MAX_DAEMON_NAME) -> None:
    if not 0 < len(value) <= limit:
        raise InvalidMessage(f"{name} must be 1..{limit} characters")


def _ranks(ranks: tuple[int, ...], world_size: int) -> None:
    for rank in ranks:
        if not 0 <= rank < world_size:
            raise InvalidMessage(f"rank {rank} is not in 0..{world_size - 1}")


# ---- the handshake ---------------------------------------------------------------


def _incarnation(value: bytes) -> None:
    if len(value) != INCARNATION_BYTES:
        raise InvalidMessage(f"an incarnation is {INCARNATION_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class PeerHello:
    version: int
    daemon: str  # the dialer's name, unique in the cluster (host:port of its peer port)
    nonce: bytes
    # its process (random at start); empty only from an older protocol, refused by version
    incarnation: bytes = b""

    def __post_init__(self) -> None:
        check_u64("version", self.version)
        _name("daemon", self.daemon)
        if len(self.nonce) != NONCE_BYTES:
            raise InvalidMessage(f"a nonce is {NONCE_BYTES} bytes")
        if self.incarnation:
            _incarnation(self.incarnation)


@dataclass(frozen=True, slots=True)
class PeerChallenge:
    daemon: str
    nonce: bytes
    proof: bytes
    incarnation: bytes

    def __post_init__(self) -> None:
        _name("daemon", self.daemon)
        if len(self.nonce) != NONCE_BYTES or len(self.proof) != 32:
            raise InvalidMessage("a challenge carries a 32-byte nonce and a 32-byte proof")
        _incarnation(self.incarnation)


@dataclass(frozen=True, slots=True)
class PeerProof:
    proof: bytes

    def __post_init__(self) -> None:
        if len(self.proof) != 32:
            raise InvalidMessage("a proof is 32 bytes")


@dataclass(frozen=True, slots=True)
class PeerReady:
    pass


MAX_REASON = 1024  # characters of a PeerRefused's, a PeerBusy's or a Goodbye's reason


def _reason(reason: str) -> None:
    if len(reason) > MAX_REASON:
        raise InvalidMessage(f"a reason is at most {MAX_REASON} characters")


@dataclass(frozen=True, slots=True)
class PeerRefused:
    reason: str

    def __post_init__(self) -> None:
        _reason(self.reason)


@dataclass(frozen=True, slots=True)
class PeerBusy:
    """The listener has no room for one more handshake now (too many under way): unlike a
    refusal, this one passes, and the dialer dials again. Sent first, before the hello is
    read, so the version cannot announce it: a dialer that does not know it takes it for a
    listener that does not speak the protocol, a refusal, as PeerRefused was before it."""

    reason: str

    def __post_init__(self) -> None:
        _reason(self.reason)


def transcript(hello: PeerHello, listener: str, listener_incarnation: bytes, listener_nonce: bytes) -> bytes:
    """What both proofs of a handshake cover: every field either side sent, each
    length-prefixed so that no two transcripts read alike."""
    fields = (str(hello.version).encode(), hello.daemon.encode(), hello.incarnation, hello.nonce,
              listener.encode(), listener_incarnation, listener_nonce)
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def proof(secret: bytes, role: str, transcript: bytes) -> bytes:
    """What side `role` ("listener" or "dialer") sends to show it holds `secret`."""
    return hmac.new(secret, role.encode() + b"|" + transcript, hashlib.sha256).digest()



# ---- after the handshake -----------------------------------------------------------


MAX_QUIET_MS = 120_000  # twice the longest a daemon announces (ncclCommAbort's limit, 60 s)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent on every link at a fixed interval. `quiet_ms`: the sender's event loop may
    stall for up to this long from now (an ncclCommAbort runs on it), and its peer does
    not count that silence against the link."""

    seq: int
    quiet_ms: int = 0

    def __post_init__(self) -> None:
        check_u64("seq", self.seq)
        if not 0 <= self.quiet_ms <= MAX_QUIET_MS:
            raise InvalidMessage(f"quiet_ms must be 0..{MAX_QUIET_MS}")


@dataclass(frozen=True, slots=True)
class Goodbye:
    """The sender closes the link on purpose (it stops), after the frames queued before this
    one: the other daemon is told why, not that the daemon was lost (a closed connection
    alone reads the same as a crash)."""

    reason: str

    def __post_init__(self) -> None:
        _reason(self.reason)


@dataclass(frozen=True, slots=True)
class JoinWorld:
    """A daemon tells the world's root that `rank` is here: a new hello (`epoch` 0) or an
    attempt_reconnect at `epoch`. `vote` is the sender's id for this vote, which the root's
    JoinRefused echoes: a refusal of an earlier vote for the rank (crossing its withdrawal)
    must not refuse the one cast since. `timeout_ms` is the time the rank has left (dialing
    the root took some), `whole_ms` the rank's whole timeout, which the root's refusal names
    (0: the same as `timeout_ms`)."""

    world: str
    world_size: int
    rank: int
    epoch: int
    timeout_ms: int
    token: str | None = None
    vote: int = 0
    whole_ms: int = 0

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        if not 0 < self.world_size <= MAX_RANKS:
            raise InvalidMessage(f"world_size={self.world_size} must be 1..{MAX_RANKS}")
        _ranks((self.rank,), self.world_size)
        check_u64("epoch", self.epoch)
        if not 0 < self.timeout_ms <= U64_MAX:
            raise InvalidMessage("timeout_ms must be positive")
        if self.token is not None:
            check_short_text("token", self.token)
        check_u64("vote", self.vote)
        check_u64("whole_ms", self.whole_ms)


@dataclass(frozen=True, slots=True)
class JoinRefused:
    """The root refuses (or times out) one rank's join: the JoinWorld whose `vote` this is."""

    world: str
    rank: int
    code: ErrorCode | str  # (a string: one a newer daemon has, see WorldFailed)
    message: str
    vote: int = 0

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("rank", self.rank)
        object.__setattr__(self, "code", error_code(self.code))
        object.__setattr__(self, "message", clip_text(self.message))  # (see WorldFailed)
        check_u64("vote", self.vote)


@dataclass(frozen=True, slots=True)
class JoinWithdrawn:
    """A member's rank that joined went away before the world formed: the root forgets
    its vote (else it would form the world with a dead rank)."""

    world: str
    rank: int

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("rank", self.rank)


@dataclass(frozen=True, slots=True)
class WorldReady:
    """The root's word that every rank is present: `placement[rank]` names its daemon."""

    world: str
    epoch: int
    placement: tuple[str, ...]
    engine_id: bytes = b""  # the root engine's unique_id() (NCCL's ncclUniqueId), if it needs one

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("epoch", self.epoch)
        if not 0 < len(self.placement) <= MAX_RANKS:
            raise InvalidMessage("placement names 1..MAX_RANKS daemons")
        for daemon in self.placement:
            _name("daemon", daemon)
        if not isinstance(self.engine_id, bytes) or len(self.engine_id) > MAX_ENGINE_ID:
            raise InvalidMessage(f"engine_id must be bytes of at most {MAX_ENGINE_ID}")


@dataclass(frozen=True, slots=True)
class WorldFailed:
    """A code this daemon does not know (a newer daemon's) stays its string, and a message
    over MAX_ERROR_TEXT is clipped, as in the Unix protocol's Error: refused as a bad frame,
    either would cost the link and every world over it, and the world would fail without
    the sender's word of why."""

    world: str
    epoch: int
    code: ErrorCode | str
    message: str

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("epoch", self.epoch)
        object.__setattr__(self, "code", error_code(self.code))
        object.__setattr__(self, "message", clip_text(self.message))  # (see WorldFailed)


# A CallsReport's distinct calls, and each one's text: a daemon's ranks at thousands of calls
# are told as that many at once (the failure that names them holds a few KiB anyway)
MAX_CALL_GROUPS = 256
MAX_CALL_TEXT = 256


@dataclass(frozen=True, slots=True)
class CallsQuery:
    """A daemon whose watchdog is about to fail `world` for a call timeout asks each other
    daemon of it for its ranks' newest calls: its failure then names the rank behind, not
    only its own ranks. `asker` is the daemon that asks, `ask` its id for the question,
    which the answers echo. A member asks the root, which answers and passes the query on
    to every other member."""

    world: str
    epoch: int
    ask: int
    asker: str

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("epoch", self.epoch)
        check_u64("ask", self.ask)
        _name("asker", self.asker)


@dataclass(frozen=True, slots=True)
class CallsReport:
    """`daemon`'s answer to `asker`'s CallsQuery `ask` (a member's goes over the root, which
    passes it on): `ranks[i]`'s newest call is `calls[call_of[i]]`. Each call is said once
    however many ranks are at it, so that the asker can group every daemon's ranks by call."""

    world: str
    epoch: int
    ask: int
    asker: str
    daemon: str
    calls: tuple[str, ...]
    ranks: tuple[int, ...]
    call_of: tuple[int, ...]

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("epoch", self.epoch)
        check_u64("ask", self.ask)
        _name("asker", self.asker)
        _name("daemon", self.daemon)
        if len(self.calls) > MAX_CALL_GROUPS:
            raise InvalidMessage(f"a report names at most {MAX_CALL_GROUPS} calls")
        for call in self.calls:
            check_short_text("a call", call, MAX_CALL_TEXT)
        if len(self.ranks) > MAX_RANKS or len(self.call_of) != len(self.ranks):
            raise InvalidMessage(f"a report names at most {MAX_RANKS} ranks, each with its call")
        _ranks(self.ranks, MAX_RANKS)
        for index in self.call_of:
            if not 0 <= index < len(self.calls):
                raise InvalidMessage(f"call {index} is not one of the report's {len(self.calls)}")


@dataclass(frozen=True, slots=True)
class Data:
    """Bytes of one op of a world, in the frame's payload.

    `key` names the transfer within the epoch (which call, which part of the
    algorithm, which chunk); the receiving engine matches it with what it waits
    for. `fingerprint` is the sender's call as matched, for cross-daemon
    mismatch detection; `about` names the ranks the payload stands for.
    """

    world: str
    epoch: int
    step: str  # which part of which algorithm: "up", "down", "p2p", ... (WIRE.md: "Steps of data")
    call: int  # the call's index (collectives) or its index on its (src, dst) pair (p2p)
    chunk: int
    source: int  # sender-specific: a rank, or 0
    fingerprint: str
    about: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _name("world", self.world, MAX_WORLD_NAME)
        check_u64("epoch", self.epoch)
        _name("step", self.step, 32)
        for name in ("call", "chunk", "source"):
            check_u64(name, getattr(self, name))
        if len(self.fingerprint) > 256 or len(self.about) > MAX_RANKS:
            raise InvalidMessage("data fingerprint or rank list too long")
        for rank in self.about:
            if not 0 <= rank < MAX_RANKS:
                raise InvalidMessage(f"rank {rank} in `about` is not a rank")

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.step, self.call, self.chunk, self.source)


PEER_MESSAGES: tuple[type, ...] = (
    PeerHello, PeerChallenge, PeerProof, PeerReady, PeerRefused, PeerBusy, Heartbeat, Goodbye,
    JoinWorld, JoinRefused, JoinWithdrawn, WorldReady, WorldFailed, CallsQuery, CallsReport, Data,
)
PeerMessage = (
    PeerHello | PeerChallenge | PeerProof | PeerReady | PeerRefused | PeerBusy | Heartbeat | Goodbye
    | JoinWorld | JoinRefused | JoinWithdrawn | WorldReady | WorldFailed | CallsQuery | CallsReport | Data
)
