"""Daemon-to-daemon messages (proto/peer.py) and their codec (`encode_peer`, `decode_peer`):
round trips, validation, the two namespaces, fuzzing, framing and the handshake proof."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import proto
from proto import DecodeError, ErrorCode, InvalidMessage, MessageTooLarge, ProtoError
from proto import peer as p
from proto import peerframe as pf
from proto.codec import TAGS, decode_peer, encode_peer
from proto.fields import MAX_ERROR_TEXT, MAX_MESSAGE_BYTES, MAX_RANKS, MAX_WORLD_NAME, U64_MAX
from proto.peer import (
    INCARNATION_BYTES,
    NONCE_BYTES,
    PEER_MESSAGES,
    PEER_VERSION,
    CallsQuery,
    CallsReport,
    Data,
    Goodbye,
    Heartbeat,
    JoinRefused,
    JoinWithdrawn,
    JoinWorld,
    PeerBusy,
    PeerChallenge,
    PeerHello,
    PeerProof,
    PeerReady,
    PeerRefused,
    WorldFailed,
    WorldReady,
)
from proto.peerframe import FRAME, MAX_PAYLOAD_BYTES, frame, frame_lengths

pytestmark = pytest.mark.timeout(60)

FAST = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
GARBAGE = settings(max_examples=2000, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


def pack(raw: Any) -> bytes:
    data: bytes = msgpack.packb(raw, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def check_roundtrip(msg: Any) -> None:
    """Decodes to an equal message, and re-encodes to the very same bytes."""
    data = encode_peer(msg)
    again = decode_peer(data)
    assert type(again) is type(msg)
    assert again == msg
    assert encode_peer(again) == data


# ---- explicit examples ------------------------------------------------------------

N1, N2 = bytes(range(NONCE_BYTES)), bytes(range(100, 100 + NONCE_BYTES))
PROOF = hashlib.sha256(b"proof").digest()
INC = bytes(range(INCARNATION_BYTES))

EXAMPLES: tuple[Any, ...] = (
    PeerHello(PEER_VERSION, "10.0.0.1:29600", N1, INC),
    PeerHello(1, "an older daemon", N1),  # (refused by its version, after decoding)
    PeerHello(U64_MAX, "d" * 256, b"\xff" * NONCE_BYTES),
    PeerHello(0, "ñ☃", b"\x00" * NONCE_BYTES),
    PeerChallenge("node-b:29600", N2, PROOF, INC),
    PeerChallenge("x" * 256, b"\x00" * NONCE_BYTES, b"\xff" * 32, b"\x00" * INCARNATION_BYTES),
    PeerProof(PROOF),
    PeerReady(),
    PeerRefused(""),
    PeerRefused("wrong proof: this daemon does not share our secret"),
    PeerRefused("r" * 1024),
    PeerBusy("16 handshakes from 10.0.0.7 are under way already"),
    Heartbeat(0),
    Heartbeat(U64_MAX),
    Heartbeat(3, quiet_ms=p.MAX_QUIET_MS),
    Goodbye("daemon shutting down"),
    Goodbye("g" * 1024),
    JoinWorld("job-17", 4, 3, 0, 60_000),
    JoinWorld("w" * MAX_WORLD_NAME, MAX_RANKS, MAX_RANKS - 1, U64_MAX, U64_MAX, token="t" * 256,
              vote=U64_MAX, whole_ms=U64_MAX),
    JoinWorld("w", 1, 0, 7, 1, token=""),
    JoinWorld("job-17", 4, 3, 0, 1_300, vote=2, whole_ms=4_000),
    JoinRefused("job-17", 2, ErrorCode.PERMISSION, "wrong join token"),
    JoinWithdrawn("job-17", 2),
    JoinWithdrawn("w" * MAX_WORLD_NAME, U64_MAX),
    JoinRefused("w", U64_MAX, ErrorCode.TIMEOUT, "m" * 4096, vote=U64_MAX),
    *(JoinRefused("w", 0, code, code.value) for code in ErrorCode),
    WorldReady("job-17", 1, ("a:1", "a:1", "b:2", "b:2")),
    WorldReady("w" * MAX_WORLD_NAME, U64_MAX, ("d" * 256,)),
    WorldFailed("job-17", 3, ErrorCode.PEER_LOST, "daemon b:2 went silent"),
    WorldFailed("w", 0, ErrorCode.MISMATCH, ""),
    WorldFailed("w", U64_MAX, ErrorCode.WORLD_FAILED, "é" * 4096),
    CallsQuery("job-17", 1, 1, "b:2"),
    CallsQuery("w" * MAX_WORLD_NAME, U64_MAX, U64_MAX, "d" * 256),
    CallsReport("job-17", 1, 1, "a:1", "b:2", ("#0 barrier() pending", "no call yet"), (2, 3), (0, 1)),
    CallsReport("w", 0, 0, "a", "b", (), (), ()),
    Data("job-17", 1, "partial", 12, 0, 3, "all_reduce(4096, bf16, sum)", (0, 1)),
    Data("w", 0, "p2p", 0, 0, 0, ""),
    Data("w" * MAX_WORLD_NAME, U64_MAX, "s" * 32, U64_MAX, U64_MAX, U64_MAX, "f" * 256,
         tuple(range(64))),
)


def test_examples_cover_every_peer_message() -> None:
    assert {type(msg) for msg in EXAMPLES} == set(PEER_MESSAGES)
    assert all(cls in TAGS for cls in PEER_MESSAGES)
    assert len({TAGS[cls] for cls in PEER_MESSAGES}) == len(PEER_MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_example_roundtrip(msg: Any) -> None:
    check_roundtrip(msg)


def test_wire_shape_is_a_tagged_map() -> None:
    assert unpack(encode_peer(Heartbeat(7))) == {"t": "heartbeat", "seq": 7, "quiet_ms": 0}
    assert decode_peer(pack({"t": "heartbeat", "seq": 7})) == Heartbeat(7, quiet_ms=0)
    assert unpack(encode_peer(PeerReady())) == {"t": "peer_ready"}
    raw = unpack(encode_peer(WorldFailed("w", 2, ErrorCode.TIMEOUT, "late")))
    assert raw == {"t": "world_failed", "world": "w", "epoch": 2, "code": "timeout", "message": "late"}
    raw = unpack(encode_peer(Data("w", 1, "p2p", 3, 4, 5, "fp", (1, 2))))
    assert raw["about"] == [1, 2] and raw["t"] == "data"
    assert type(unpack(encode_peer(PeerProof(PROOF)))["proof"]) is bytes  # bin, not str
    # a hand-built map with the optional field left out decodes to the default
    assert decode_peer(pack({"t": "join_world", "world": "w", "world_size": 2, "rank": 1,
                             "epoch": 0, "timeout_ms": 5})) == JoinWorld("w", 2, 1, 0, 5)
    data = decode_peer(pack({"t": "data", "world": "w", "epoch": 0, "step": "up", "call": 0,
                             "chunk": 0, "source": 0, "fingerprint": ""}))
    assert isinstance(data, Data) and data.about == ()


def test_a_calls_report_of_every_rank_at_the_most_calls_fits_a_sealed_header() -> None:
    """The biggest answer a daemon can give (its every rank, each call as long as allowed):
    the frame of one that did not fit would drop the link, and every world over it."""
    calls = tuple(f"{i:03d}" + "c" * (p.MAX_CALL_TEXT - 3) for i in range(p.MAX_CALL_GROUPS))
    ranks = tuple(range(MAX_RANKS))
    report = CallsReport("w" * MAX_WORLD_NAME, U64_MAX, U64_MAX, "a" * 256, "b" * 256, calls, ranks,
                         tuple(r % p.MAX_CALL_GROUPS for r in ranks))
    assert len(encode_peer(report)) <= pf.MAX_SEALED_HEADER_BYTES
    check_roundtrip(report)


def test_data_key() -> None:
    assert Data("w", 1, "result", 4, 2, 9, "fp").key == ("result", 4, 2, 9)


# ---- hypothesis strategies: valid instances of every class --------------------------

u64 = st.integers(0, U64_MAX)
texts = st.text(max_size=40)
daemons = st.text(min_size=1, max_size=40) | st.text(min_size=256, max_size=256)
worlds = st.text(min_size=1, max_size=MAX_WORLD_NAME)
nonces = st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES)
incarnations = st.binary(min_size=INCARNATION_BYTES, max_size=INCARNATION_BYTES)
proofs = st.binary(min_size=32, max_size=32)
codes = st.sampled_from(ErrorCode)


@st.composite
def calls_reports(draw: st.DrawFn) -> CallsReport:
    calls = draw(st.lists(st.text(max_size=p.MAX_CALL_TEXT), max_size=8).map(tuple))
    ranks = draw(st.lists(st.integers(0, MAX_RANKS - 1), max_size=16 if calls else 0).map(tuple))
    call_of = tuple(draw(st.integers(0, len(calls) - 1)) for _ in ranks)
    return CallsReport(draw(worlds), draw(u64), draw(u64), draw(daemons), draw(daemons), calls, ranks,
                       call_of)


@st.composite
def join_worlds(draw: st.DrawFn) -> JoinWorld:
    world_size = draw(st.integers(1, MAX_RANKS))
    return JoinWorld(draw(worlds), world_size, draw(st.integers(0, world_size - 1)), draw(u64),
                     draw(st.integers(1, U64_MAX)), draw(st.none() | st.text(max_size=256)), draw(u64),
                     draw(u64))


STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    PeerHello: st.builds(PeerHello, u64, daemons, nonces, incarnations),
    PeerChallenge: st.builds(PeerChallenge, daemons, nonces, proofs, incarnations),
    PeerProof: st.builds(PeerProof, proofs),
    PeerReady: st.just(PeerReady()),
    PeerRefused: st.builds(PeerRefused, st.text(max_size=1024)),
    PeerBusy: st.builds(PeerBusy, st.text(max_size=1024)),
    Heartbeat: st.builds(Heartbeat, u64),
    Goodbye: st.builds(Goodbye, st.text(max_size=1024)),
    JoinWorld: join_worlds(),
    JoinRefused: st.builds(JoinRefused, worlds, u64, codes, texts),
    JoinWithdrawn: st.builds(JoinWithdrawn, worlds, u64),
    WorldReady: st.builds(WorldReady, worlds, u64,
                          st.lists(daemons, min_size=1, max_size=8).map(tuple)),
    WorldFailed: st.builds(WorldFailed, worlds, u64, codes, st.text(max_size=4096)),
    CallsQuery: st.builds(CallsQuery, worlds, u64, u64, daemons),
    CallsReport: calls_reports(),
    Data: st.builds(Data, worlds, u64, st.text(min_size=1, max_size=32), u64, u64, u64,
                    st.text(max_size=256),
                    st.lists(st.integers(0, MAX_RANKS - 1), max_size=16).map(tuple)),
}
peer_messages = st.one_of(*STRATEGIES.values())


def test_strategies_cover_every_peer_message() -> None:
    assert set(STRATEGIES) == set(PEER_MESSAGES)


@FAST
@given(msg=peer_messages)
def test_generated_roundtrip(msg: Any) -> None:
    event(type(msg).__name__)
    check_roundtrip(msg)


# ---- validation -----------------------------------------------------------------------

W = "w"
GOOD_NONCE = b"\x01" * NONCE_BYTES
BAD: dict[str, Callable[[], object]] = {
    "hello nonce short": lambda: PeerHello(1, "d", b"\x01" * (NONCE_BYTES - 1)),
    "hello nonce long": lambda: PeerHello(1, "d", b"\x01" * (NONCE_BYTES + 1)),
    "hello nonce empty": lambda: PeerHello(1, "d", b""),
    "hello daemon empty": lambda: PeerHello(1, "", GOOD_NONCE),
    "hello daemon long": lambda: PeerHello(1, "d" * 257, GOOD_NONCE),
    "hello version negative": lambda: PeerHello(-1, "d", GOOD_NONCE),
    "hello version over u64": lambda: PeerHello(U64_MAX + 1, "d", GOOD_NONCE),
    "hello incarnation short": lambda: PeerHello(1, "d", GOOD_NONCE, INC[:-1]),
    "challenge nonce short": lambda: PeerChallenge("d", b"\x01" * 31, PROOF, INC),
    "challenge proof short": lambda: PeerChallenge("d", GOOD_NONCE, PROOF[:31], INC),
    "challenge proof long": lambda: PeerChallenge("d", GOOD_NONCE, PROOF + b"\x00", INC),
    "challenge daemon empty": lambda: PeerChallenge("", GOOD_NONCE, PROOF, INC),
    "challenge daemon long": lambda: PeerChallenge("d" * 257, GOOD_NONCE, PROOF, INC),
    "challenge incarnation empty": lambda: PeerChallenge("d", GOOD_NONCE, PROOF, b""),
    "challenge incarnation long": lambda: PeerChallenge("d", GOOD_NONCE, PROOF, INC + b"\x00"),
    "proof short": lambda: PeerProof(PROOF[:31]),
    "proof long": lambda: PeerProof(PROOF * 2),
    "proof empty": lambda: PeerProof(b""),
    "refused reason long": lambda: PeerRefused("r" * 1025),
    "busy reason long": lambda: PeerBusy("r" * 1025),
    "goodbye reason long": lambda: Goodbye("r" * 1025),
    "heartbeat negative": lambda: Heartbeat(-1),
    "heartbeat over u64": lambda: Heartbeat(U64_MAX + 1),
    "quiet for longer than a stall may last": lambda: Heartbeat(1, quiet_ms=p.MAX_QUIET_MS + 1),
    "quiet for less than nothing": lambda: Heartbeat(1, quiet_ms=-1),
    "join world empty": lambda: JoinWorld("", 2, 0, 0, 1),
    "join world long": lambda: JoinWorld("w" * (MAX_WORLD_NAME + 1), 2, 0, 0, 1),
    "join world_size 0": lambda: JoinWorld(W, 0, 0, 0, 1),
    "join world_size over max": lambda: JoinWorld(W, MAX_RANKS + 1, 0, 0, 1),
    "join rank == world_size": lambda: JoinWorld(W, 4, 4, 0, 1),
    "join rank > world_size": lambda: JoinWorld(W, 4, 9, 0, 1),
    "join rank negative": lambda: JoinWorld(W, 4, -1, 0, 1),
    "join epoch negative": lambda: JoinWorld(W, 4, 0, -1, 1),
    "join epoch over u64": lambda: JoinWorld(W, 4, 0, U64_MAX + 1, 1),
    "join timeout 0": lambda: JoinWorld(W, 4, 0, 0, 0),
    "join timeout negative": lambda: JoinWorld(W, 4, 0, 0, -5),
    "join timeout over u64": lambda: JoinWorld(W, 4, 0, 0, U64_MAX + 1),
    "join token long": lambda: JoinWorld(W, 4, 0, 0, 1, token="t" * 257),
    "join vote negative": lambda: JoinWorld(W, 4, 0, 0, 1, vote=-1),
    "join whole timeout negative": lambda: JoinWorld(W, 4, 0, 0, 1, whole_ms=-1),
    "join whole timeout over u64": lambda: JoinWorld(W, 4, 0, 0, 1, whole_ms=U64_MAX + 1),
    "join vote over u64": lambda: JoinWorld(W, 4, 0, 0, 1, vote=U64_MAX + 1),
    "join refused world empty": lambda: JoinRefused("", 0, ErrorCode.TIMEOUT, ""),
    "join refused rank negative": lambda: JoinRefused(W, -1, ErrorCode.TIMEOUT, ""),
    "join refused rank over u64": lambda: JoinRefused(W, U64_MAX + 1, ErrorCode.TIMEOUT, ""),
    "join refused vote negative": lambda: JoinRefused(W, 0, ErrorCode.TIMEOUT, "", vote=-1),
    "ready world long": lambda: WorldReady("w" * (MAX_WORLD_NAME + 1), 0, ("a",)),
    "ready epoch negative": lambda: WorldReady(W, -1, ("a",)),
    "ready placement empty": lambda: WorldReady(W, 0, ()),
    "ready placement name empty": lambda: WorldReady(W, 0, ("a", "")),
    "ready placement name long": lambda: WorldReady(W, 0, ("d" * 257,)),
    "ready placement over max": lambda: WorldReady(W, 0, ("a",) * (MAX_RANKS + 1)),
    "failed world empty": lambda: WorldFailed("", 0, ErrorCode.PEER_LOST, ""),
    "failed epoch over u64": lambda: WorldFailed(W, U64_MAX + 1, ErrorCode.PEER_LOST, ""),
    "calls query world empty": lambda: CallsQuery("", 0, 0, "a"),
    "calls query ask negative": lambda: CallsQuery(W, 0, -1, "a"),
    "calls query asker empty": lambda: CallsQuery(W, 0, 0, ""),
    "calls query asker long": lambda: CallsQuery(W, 0, 0, "a" * 257),
    "calls report epoch over u64": lambda: CallsReport(W, U64_MAX + 1, 0, "a", "b", (), (), ()),
    "calls report daemon empty": lambda: CallsReport(W, 0, 0, "a", "", (), (), ()),
    "calls report too many calls": lambda: CallsReport(W, 0, 0, "a", "b", ("c",) * (p.MAX_CALL_GROUPS + 1),
                                                       (), ()),
    "calls report call long": lambda: CallsReport(W, 0, 0, "a", "b", ("c" * (p.MAX_CALL_TEXT + 1),), (), ()),
    "calls report ranks over max": lambda: CallsReport(W, 0, 0, "a", "b", ("c",), (0,) * (MAX_RANKS + 1),
                                                       (0,) * (MAX_RANKS + 1)),
    "calls report rank not a rank": lambda: CallsReport(W, 0, 0, "a", "b", ("c",), (MAX_RANKS,), (0,)),
    "calls report rank without its call": lambda: CallsReport(W, 0, 0, "a", "b", ("c",), (0, 1), (0,)),
    "calls report call not in it": lambda: CallsReport(W, 0, 0, "a", "b", ("c",), (0,), (1,)),
    "data world empty": lambda: Data("", 0, "p2p", 0, 0, 0, ""),
    "data world long": lambda: Data("w" * (MAX_WORLD_NAME + 1), 0, "p2p", 0, 0, 0, ""),
    "data epoch negative": lambda: Data(W, -1, "p2p", 0, 0, 0, ""),
    "data step empty": lambda: Data(W, 0, "", 0, 0, 0, ""),
    "data step long": lambda: Data(W, 0, "s" * 33, 0, 0, 0, ""),
    "data call negative": lambda: Data(W, 0, "p2p", -1, 0, 0, ""),
    "data chunk over u64": lambda: Data(W, 0, "p2p", 0, U64_MAX + 1, 0, ""),
    "data source negative": lambda: Data(W, 0, "p2p", 0, 0, -1, ""),
    "data fingerprint long": lambda: Data(W, 0, "p2p", 0, 0, 0, "f" * 257),
    "data about over max": lambda: Data(W, 0, "p2p", 0, 0, 0, "", (0,) * (MAX_RANKS + 1)),
}


@pytest.mark.parametrize("make", BAD.values(), ids=BAD.keys())
def test_constructor_refuses_bad_values(make: Callable[[], object]) -> None:
    with pytest.raises(InvalidMessage):
        make()


def test_invalid_message_is_a_proto_error_and_value_error() -> None:
    assert issubclass(InvalidMessage, ProtoError) and issubclass(InvalidMessage, ValueError)


def _raw(msg: Any, **changes: Any) -> bytes:
    raw = unpack(encode_peer(msg))
    raw.update(changes)
    return pack(raw)


HB = Heartbeat(1)
HELLO = PeerHello(PEER_VERSION, "d", GOOD_NONCE, INC)
JOIN = JoinWorld("w", 4, 0, 0, 1000)
DATA = Data("w", 0, "p2p", 0, 0, 0, "fp")
REPORT = CallsReport("w", 1, 1, "a", "b", ("#0 barrier() pending",), (2,), (0,))

# well-formed maps whose values break a rule: the constructor's check runs on decode too
DECODED_INVALID: dict[str, bytes] = {
    "seq negative": _raw(HB, seq=-1),
    "hello nonce short": _raw(HELLO, nonce=b"\x00" * 31),
    "hello daemon empty": _raw(HELLO, daemon=""),
    "proof long": _raw(PeerProof(PROOF), proof=PROOF + b"!"),
    "join rank == world_size": _raw(JOIN, rank=4),
    "join world_size 0": _raw(JOIN, world_size=0, rank=0),
    "join timeout 0": _raw(JOIN, timeout_ms=0),
    "join world long": _raw(JOIN, world="w" * (MAX_WORLD_NAME + 1)),
    "ready placement empty": _raw(WorldReady("w", 0, ("a",)), placement=[]),
    "data step long": _raw(DATA, step="s" * 33),
    "calls report call not in it": _raw(REPORT, call_of=[1]),
    "calls report rank without its call": _raw(REPORT, ranks=[2, 3]),
    "calls report rank not a rank": _raw(REPORT, ranks=[MAX_RANKS]),
    "calls query asker empty": _raw(CallsQuery("w", 1, 1, "a"), asker=""),
    "data call negative": _raw(DATA, call=-(1 << 63)),
    "refused reason long": _raw(PeerRefused("x"), reason="r" * 1025),
    "busy reason long": _raw(PeerBusy("x"), reason="r" * 1025),
    "goodbye reason long": _raw(Goodbye("x"), reason="r" * 1025),
    "error code long": _raw(WorldFailed("w", 0, ErrorCode.TIMEOUT, ""),
                            code="c" * (proto.MAX_ERROR_CODE + 1)),
    "error code empty": _raw(JoinRefused("w", 0, ErrorCode.TIMEOUT, ""), code=""),
}


def test_a_hello_of_another_version_decodes_with_fields_this_one_lacks() -> None:
    """So that the listener refuses it by its version in words (WIRE.md §9): one it cannot read
    it drops without a word, which the dialer takes for a listener too busy to answer."""
    newer = PeerHello(p.PEER_VERSION + 1, "newer", N1, INC)
    assert decode_peer(_raw(newer, features=["compression"])) == newer
    # its incarnation of another form (longer, not bytes) is dropped: it still decodes, to be refused
    assert decode_peer(_raw(newer, incarnation=INC * 2)) == PeerHello(p.PEER_VERSION + 1, "newer", N1)
    assert decode_peer(_raw(newer, incarnation=7)) == PeerHello(p.PEER_VERSION + 1, "newer", N1)
    with pytest.raises(DecodeError, match="unknown field 'features'"):  # (at this version, a bad hello)
        decode_peer(_raw(PeerHello(p.PEER_VERSION, "same", N1, INC), features=["compression"]))


@pytest.mark.parametrize("msg", [WorldFailed("w", 3, ErrorCode.TIMEOUT, "late"),
                                 JoinRefused("w", 1, ErrorCode.TIMEOUT, "late", 9)],
                         ids=["failed", "refused"])
def test_a_failure_keeps_an_error_code_it_does_not_know(msg: Any) -> None:
    """As an `error`'s in the Unix protocol (WIRE.md §9): a newer daemon's code decodes, as its
    string, where a bad frame would cost the link and every world over it."""
    newer = decode_peer(_raw(msg, code="quota_exceeded"))
    assert newer.code == "quota_exceeded" and newer.message == "late"  # type: ignore[union-attr]
    assert decode_peer(encode_peer(newer)) == newer
    assert decode_peer(_raw(msg, code="timeout")) == msg  # a code it knows is the member


@pytest.mark.parametrize("msg", [WorldFailed("w", 3, ErrorCode.TIMEOUT, "late"),
                                 JoinRefused("w", 1, ErrorCode.TIMEOUT, "late", 9)],
                         ids=["failed", "refused"])
def test_a_failure_clips_a_message_longer_than_the_rule(msg: Any) -> None:
    """A newer daemon may word a failure at more length than MAX_ERROR_TEXT: refused, the
    frame would cost the link and every world over it (as an `error`'s in the Unix protocol)."""
    longer = decode_peer(_raw(msg, message="why " * 2000))
    assert longer.message == ("why " * 2000)[:MAX_ERROR_TEXT - 20] + " ... (cut)"  # type: ignore[union-attr]
    assert len(longer.message) <= MAX_ERROR_TEXT  # type: ignore[union-attr]
    assert decode_peer(_raw(msg, message="m" * MAX_ERROR_TEXT)) == replace(msg, message="m" * MAX_ERROR_TEXT)

# maps that do not fit the schema at all
DECODED_MALFORMED: dict[str, bytes] = {
    "not a map": pack([1, 2]),
    "a bare int": pack(7),
    "empty": b"",
    "trailing bytes": encode_peer(HB) + b"\x00",
    "no tag": pack({"seq": 1}),
    "unknown tag": pack({"t": "nope"}),
    "tag not a string": pack({"t": 1}),
    "unknown field": _raw(HB, zz=1),
    "missing field": pack({"t": "heartbeat"}),
    "seq is a bool": _raw(HB, seq=True),
    "seq is a float": _raw(HB, seq=1.0),
    "seq is a string": _raw(HB, seq="1"),
    "nonce is a string": _raw(HELLO, nonce="x" * NONCE_BYTES),
    "daemon is bytes": _raw(HELLO, daemon=b"d"),
    "error code not a string": _raw(WorldFailed("w", 0, ErrorCode.TIMEOUT, ""), code=5),
    "placement not a list": _raw(WorldReady("w", 0, ("a",)), placement="a"),
    "about holds a string": _raw(DATA, about=["x"]),
    "token is an int": _raw(JOIN, token=5),
    "non-string key": pack({"t": "heartbeat", "seq": 1, 5: 1}),
    "invalid utf-8": b"\x82\xa1t\xa9heartbeat\xa3seq\x01".replace(b"heartbeat", b"heartbea\xff"),
}


@pytest.mark.parametrize("data", DECODED_INVALID.values(), ids=DECODED_INVALID.keys())
def test_decode_refuses_invalid_values(data: bytes) -> None:
    with pytest.raises(InvalidMessage):
        decode_peer(data)


@pytest.mark.parametrize("data", DECODED_MALFORMED.values(), ids=DECODED_MALFORMED.keys())
def test_decode_refuses_malformed_headers(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_peer(data)


def test_encode_refuses_a_header_over_the_limit() -> None:
    big = WorldReady("w", 0, ("d" * 256,) * 4100)  # valid, but ~1.06 MB encoded: over a sealed header's
    with pytest.raises(MessageTooLarge):
        encode_peer(big)
    with pytest.raises(MessageTooLarge):  # (~77 KB: a sealed frame's, never one in the clear)
        frame(encode_peer(WorldReady("w", 0, ("d" * 256,) * 300)))


def test_encode_refuses_unencodable_text() -> None:
    with pytest.raises(InvalidMessage):
        encode_peer(PeerRefused("\ud800"))  # a lone surrogate is not UTF-8


# ---- namespaces ---------------------------------------------------------------------

UNIX_MESSAGES: tuple[Any, ...] = (
    proto.Ok(1),
    proto.Ok(2, value=5, nfds=1),
    proto.Error(3, ErrorCode.MISUSE, "no"),
    proto.StatusQuery(4),
    proto.Reconnect(5),
    proto.Event(proto.EventKind.WORLD_FAILED, ErrorCode.PEER_LOST, "gone", 1),
)
UNIX_OPS: tuple[Any, ...] = (proto.Barrier(), proto.Send(None, 0, 1))


@pytest.mark.parametrize("msg", UNIX_MESSAGES, ids=lambda m: type(m).__name__)
def test_decode_peer_refuses_unix_messages(msg: Any) -> None:
    with pytest.raises(DecodeError, match="unknown message type"):
        decode_peer(proto.encode(msg))


@pytest.mark.parametrize("op", UNIX_OPS, ids=lambda m: type(m).__name__)
def test_decode_peer_refuses_ops(op: Any) -> None:
    with pytest.raises(DecodeError):
        decode_peer(pack(proto.codec._to_wire(op)))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_unix_side_refuses_peer_messages(msg: Any) -> None:
    with pytest.raises(ProtoError):
        proto.encode(msg)
    with pytest.raises(DecodeError, match="unknown message type"):
        proto.decode(encode_peer(msg))


@pytest.mark.parametrize("msg", [*UNIX_MESSAGES, *UNIX_OPS, object(), None, b"x"],
                         ids=lambda m: type(m).__name__)
def test_encode_peer_refuses_non_peer_messages(msg: Any) -> None:
    with pytest.raises(InvalidMessage):
        encode_peer(msg)


# ---- fuzzing: decode_peer only ever raises ProtoError ---------------------------------------


def check_decode_total(data: bytes) -> None:
    try:
        msg = decode_peer(data)
    except ProtoError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event(f"decoded: {type(msg).__name__}")
    assert type(msg) in PEER_MESSAGES
    assert decode_peer(encode_peer(msg)) == msg  # what decodes also encodes, with the same meaning


@GARBAGE
@given(data=st.binary(max_size=256))
def test_random_bytes_only_raise_proto_errors(data: bytes) -> None:
    check_decode_total(data)


odd_values: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([0, -1, 1, U64_MAX, -(1 << 63), True, False, None, "", b"", [], [0], ["a"],
                     {}, 1.5, "timeout", "p2p", GOOD_NONCE, PROOF, "x" * 300, b"\x00" * 33]),
    st.sampled_from(sorted(TAGS.values())),
    st.integers(-(1 << 63), U64_MAX),
    st.text(max_size=8),
    st.binary(max_size=40),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid peer header, reshaped at the msgpack level and/or damaged byte by byte."""
    msg = draw(st.sampled_from(EXAMPLES))
    raw = unpack(encode_peer(msg))
    reshape = draw(st.booleans())
    if reshape:
        key = draw(st.sampled_from([*sorted(raw), "zz"]))
        if draw(st.integers(0, 4)) == 0:
            raw.pop(key, None)
        else:
            raw[key] = draw(odd_values)
    data = bytearray(pack(raw))
    for _ in range(draw(st.integers(0 if reshape else 1, 3))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "splice"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete" and data:
            del data[at:at + draw(st.integers(1, 4))]
        elif kind == "truncate":
            del data[at:]
        elif kind == "splice":
            other = draw(st.sampled_from([*EXAMPLES, *UNIX_MESSAGES]))
            encoded = encode_peer(other) if type(other) in PEER_MESSAGES else proto.encode(other)
            data[at:at] = encoded[: draw(st.integers(1, 32))]
    return bytes(data)


@GARBAGE
@given(data=mutated())
def test_mutated_headers_only_raise_proto_errors(data: bytes) -> None:
    check_decode_total(data)


@settings(max_examples=300, deadline=None, database=None)
@given(prefix=st.binary(min_size=FRAME.size, max_size=FRAME.size))
def test_frame_lengths_of_random_prefixes(prefix: bytes) -> None:
    try:
        header_len, payload_len = frame_lengths(prefix)
    except DecodeError:
        return
    assert 0 < header_len <= MAX_MESSAGE_BYTES and 0 <= payload_len <= MAX_PAYLOAD_BYTES


# ---- framing -------------------------------------------------------------------------


def test_frame_pieces() -> None:
    header = encode_peer(Data("w", 1, "p2p", 0, 0, 0, "fp"))
    payload = bytes(range(256)) * 16
    pieces = frame(header, payload)
    assert len(pieces) == 3
    assert pieces[0] == FRAME.pack(len(header), len(payload)) and len(pieces[0]) == FRAME.size == 8
    assert pieces[1] is header and pieces[2] is payload  # the payload is not copied
    wire = b"".join(pieces)
    header_len, payload_len = frame_lengths(wire[:8])
    assert (header_len, payload_len) == (len(header), len(payload))
    assert decode_peer(wire[8:8 + header_len]) == decode_peer(header)
    assert wire[8 + header_len:] == payload


def test_frame_of_a_control_message_has_an_empty_payload() -> None:
    header = encode_peer(HB)
    pieces = frame(header)
    assert pieces[0] == FRAME.pack(len(header), 0) and pieces[2] == b""


def test_frame_takes_a_memoryview_payload() -> None:
    buf = bytearray(b"abcdefgh" * 100)
    view = memoryview(buf)[8:24]
    pieces = frame(b"h", view)
    assert pieces[2] is view and FRAME.unpack(pieces[0]) == (1, 16)


def test_frame_at_the_limits() -> None:
    pieces = frame(b"h" * MAX_MESSAGE_BYTES, bytes(MAX_PAYLOAD_BYTES))
    assert frame_lengths(bytes(pieces[0])) == (MAX_MESSAGE_BYTES, MAX_PAYLOAD_BYTES)


def test_frame_refuses_oversized_pieces() -> None:
    with pytest.raises(MessageTooLarge, match="header"):
        frame(b"h" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(MessageTooLarge, match="payload"):
        frame(b"h", bytes(MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(MessageTooLarge, match="payload"):
        frame(b"h", memoryview(bytearray(MAX_PAYLOAD_BYTES + 1)))


@pytest.mark.parametrize(("header_len", "payload_len"), [
    (1, 0), (1, 1), (57, 4096), (MAX_MESSAGE_BYTES, 0), (1, MAX_PAYLOAD_BYTES),
    (MAX_MESSAGE_BYTES, MAX_PAYLOAD_BYTES),
])
def test_frame_lengths_accepts_in_bounds(header_len: int, payload_len: int) -> None:
    assert frame_lengths(FRAME.pack(header_len, payload_len)) == (header_len, payload_len)


@pytest.mark.parametrize(("header_len", "payload_len"), [
    (0, 0), (0, 10), (MAX_MESSAGE_BYTES + 1, 0), (1, MAX_PAYLOAD_BYTES + 1),
    (MAX_MESSAGE_BYTES + 1, MAX_PAYLOAD_BYTES + 1), (2**32 - 1, 0), (1, 2**32 - 1),
])
def test_frame_lengths_refuses_out_of_bounds(header_len: int, payload_len: int) -> None:
    with pytest.raises(DecodeError, match="out of bounds") as info:
        frame_lengths(FRAME.pack(header_len, payload_len))
    assert type(info.value) is DecodeError


def test_frame_is_big_endian() -> None:
    assert frame(b"abc", b"de")[0] == b"\x00\x00\x00\x03\x00\x00\x00\x02"


# ---- the handshake proof -----------------------------------------------------------------


def hello_and_transcript(**changes: Any) -> bytes:
    fields = {"dialer": "a", "dialer_inc": INC, "dialer_nonce": N1, "listener": "b",
              "listener_inc": bytes(INCARNATION_BYTES), "listener_nonce": N2, **changes}
    hello = PeerHello(PEER_VERSION, fields["dialer"], fields["dialer_nonce"], fields["dialer_inc"])
    return p.transcript(hello, fields["listener"], fields["listener_inc"], fields["listener_nonce"])


def test_proof_is_the_documented_hmac() -> None:
    secret, transcript = b"s3cret", hello_and_transcript()
    got = p.proof(secret, "listener", transcript)
    assert got == hmac.new(secret, b"listener|" + transcript, hashlib.sha256).digest()
    assert len(got) == 32
    PeerProof(got)  # fits a proof message
    PeerChallenge("d", N2, got, INC)


def test_the_transcript_holds_every_field_of_both_sides() -> None:
    base = hello_and_transcript()
    for changed in ({"dialer": "c"}, {"listener": "c"}, {"dialer_inc": bytes(INCARNATION_BYTES)},
                    {"listener_inc": INC}, {"dialer_nonce": N2, "listener_nonce": N1}):
        assert hello_and_transcript(**changed) != base, changed
    # lengths are part of it: no field's bytes can move into its neighbour
    assert hello_and_transcript(dialer="ab", listener="b") != hello_and_transcript(dialer="a", listener="bb")


def test_proof_differs_by_role_transcript_and_secret() -> None:
    transcript = hello_and_transcript()
    base = p.proof(b"k", "listener", transcript)
    assert p.proof(b"k", "listener", transcript) == base
    assert p.proof(b"k", "dialer", transcript) != base  # a listener's proof is no dialer's
    assert p.proof(b"k", "listener", hello_and_transcript(dialer="impostor")) != base  # nor another name's
    assert p.proof(b"K", "listener", transcript) != base
    assert p.proof(b"", "listener", transcript) != base


@settings(max_examples=100, deadline=None, database=None)
@given(secret=st.binary(max_size=64), a=nonces, b=nonces)
def test_proof_properties(secret: bytes, a: bytes, b: bytes) -> None:
    def made(role: str, key: bytes, first: bytes, second: bytes) -> bytes:
        return p.proof(key, role, hello_and_transcript(dialer_nonce=first, listener_nonce=second))

    listener = made("listener", secret, a, b)
    assert listener == made("listener", secret, a, b)
    assert listener != made("dialer", secret, a, b)
    if a != b:
        assert listener != made("listener", secret, b, a)
    assert listener != made("listener", secret + b"!", a, b)


def test_frame_keys_differ_by_direction_secret_and_handshake() -> None:
    transcript = hello_and_transcript()
    dialers, listeners = pf.frame_keys(b"k", transcript)
    assert dialers != listeners and len(dialers) == len(listeners) == 32
    assert pf.frame_keys(b"K", transcript) != (dialers, listeners)
    another_handshake = hello_and_transcript(dialer_nonce=N2, listener_nonce=N1)
    assert pf.frame_keys(b"k", another_handshake) != (dialers, listeners)


def opened(opener: pf.FrameSeal, pieces: list[bytes]) -> tuple[bytes, bytes]:
    """A frame opened as a reader does: the header as soon as it is in, then the payload."""
    lengths, sealed_header, *sealed_payload = pieces
    header = opener.open_header(lengths, sealed_header)
    return header, opener.open_payload(lengths, sealed_payload[0]) if sealed_payload else b""


def test_a_sealed_frame_opens_only_in_its_place_with_its_key_and_every_byte() -> None:
    header, payload = encode_peer(Heartbeat(1)), b"payload"
    sender, receiver = pf.FrameSeal(bytes(32)), pf.FrameSeal(bytes(32))
    first = sender.seal(header, payload)
    lengths, sealed_header, sealed_payload = first
    assert lengths == pf.FRAME.pack(len(header), len(payload))  # the lengths of what it carries
    assert (len(sealed_header), len(sealed_payload)) == pf.sealed_lengths(len(header), len(payload))
    assert payload not in b"".join(first) and header not in b"".join(first)  # encrypted
    assert opened(receiver, first) == (header, payload)  # both ends agree, frame by frame
    second = sender.seal(header, payload)
    assert second != first  # the same frame again is sealed anew
    with pytest.raises(DecodeError, match="replayed"):
        opened(receiver, first)  # a replay (the receiver expects frame 1 now)

    def opens(pieces: list[bytes], key: bytes = bytes(32)) -> bool:
        try:
            opened(pf.FrameSeal(key), pieces)
        except DecodeError:
            return False
        return True

    assert opens(first) and not opens(first, key=b"k" * 32)
    for i in range(3):  # a bit flipped anywhere: in the lengths, the header or the payload
        changed = list(first)
        changed[i] = bytes([changed[i][0] ^ 1]) + changed[i][1:]
        assert not opens(changed)
    assert not opens([lengths, sealed_payload, sealed_header])  # parts swapped
    # the payload cut off, and the lengths made to say there was none: the header's tag covers
    # the lengths, so the reader knows before it allocates anything for a payload
    assert not opens([pf.FRAME.pack(len(header), 0), sealed_header])
    assert not opens([pf.FRAME.pack(len(header), 1 << 20), sealed_header, sealed_payload])
    assert pf.FrameSeal(bytes(32)).seal(header, b"")[2:] == []  # no payload: no payload part


def test_sealing_holds_to_the_readers_limits() -> None:
    with pytest.raises(MessageTooLarge):
        pf.FrameSeal(bytes(32)).seal(b"h", bytes(MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(MessageTooLarge):
        pf.FrameSeal(bytes(32)).seal(bytes(pf.MAX_SEALED_HEADER_BYTES + 1), b"")


def test_a_sealed_header_may_be_larger_than_one_in_the_clear() -> None:
    """A sealed frame comes from a daemon that proved the secret: its header may take 1 MiB (a
    world_ready naming thousands of ranks' daemons); a frame in the clear (a handshake's, from
    anyone) still 64 KiB, so a stranger's connections make the daemon buffer no more."""
    big = bytes(MAX_MESSAGE_BYTES + 1)
    sender, receiver = pf.FrameSeal(bytes(32)), pf.FrameSeal(bytes(32))
    pieces = sender.seal(big, b"")
    assert frame_lengths(pieces[0], sealed=True) == (len(big), 0)
    assert opened(receiver, pieces) == (big, b"")
    with pytest.raises(DecodeError, match="out of bounds"):
        frame_lengths(pieces[0])  # (in the clear)
    with pytest.raises(MessageTooLarge, match="header"):
        frame(big)
    limit = pf.MAX_SEALED_HEADER_BYTES
    assert frame_lengths(FRAME.pack(limit, MAX_PAYLOAD_BYTES), sealed=True) == (limit, MAX_PAYLOAD_BYTES)
    with pytest.raises(DecodeError, match="out of bounds"):
        frame_lengths(FRAME.pack(limit + 1, 0), sealed=True)
    ready = WorldReady("w", 1, ("d" * 256,) * 4000)  # ~1 MB
    assert MAX_MESSAGE_BYTES < len(encode_peer(ready)) <= limit
    with pytest.raises(MessageTooLarge):
        encode_peer(WorldReady("w", 1, ("d" * 256,) * 4100))
