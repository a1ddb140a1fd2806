"""msgpack encoding of messages: one message per packet, a map with a type tag `t`.

The schema is read once from the dataclasses' type hints, so adding a field to a
message is the whole change. Decoding never raises anything but `ProtoError`.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any

import msgpack

from . import messages as m
from . import ops as o
from . import peer as p
from . import peerframe as pf
from .errors import DecodeError, InvalidMessage, MessageTooLarge, ProtoError
from .fields import MAX_MESSAGE_BYTES, U64_MAX

TAGS: dict[type, str] = {
    o.AllReduce: "all_reduce",
    o.AllGather: "all_gather",
    o.ReduceScatter: "reduce_scatter",
    o.Broadcast: "broadcast",
    o.Barrier: "barrier",
    o.Send: "send",
    o.Recv: "recv",
    m.Hello: "hello",
    m.Import: "import",
    m.Forget: "forget",
    m.Submit: "submit",
    m.StreamEvents: "stream_events",
    m.StreamSubmit: "stream_submit",
    m.Register: "register",
    m.Deregister: "deregister",
    m.SymAlloc: "sym_alloc",
    m.SymFree: "sym_free",
    m.SetAddKernel: "set_add_kernel",
    m.Reconnect: "reconnect",
    m.StatusQuery: "status",
    m.Welcome: "welcome",
    m.Ok: "ok",
    m.Error: "error",
    m.Event: "event",
    m.StatusReport: "status_report",
    p.PeerHello: "peer_hello",
    p.PeerChallenge: "peer_challenge",
    p.PeerProof: "peer_proof",
    p.PeerReady: "peer_ready",
    p.PeerRefused: "peer_refused",
    p.PeerBusy: "peer_busy",
    p.Heartbeat: "heartbeat",
    p.Goodbye: "goodbye",
    p.JoinWorld: "join_world",
    p.JoinRefused: "join_refused",
    p.JoinWithdrawn: "join_withdrawn",
    p.WorldReady: "world_ready",
    p.WorldFailed: "world_failed",
    p.CallsQuery: "calls_query",
    p.CallsReport: "calls_report",
    p.Data: "data",
}
_BY_TAG = {tag: cls for cls, tag in TAGS.items()}
_OP_TAGS = frozenset(TAGS[cls] for cls in o.OP_TYPES)
_PEER_TAGS = {TAGS[cls]: cls for cls in p.PEER_MESSAGES}  # the daemon-to-daemon namespace
# what a Unix-socket packet may be: ops ride inside a submit, peer messages only on TCP links
_MESSAGE_TAGS = {tag: cls for tag, cls in _BY_TAG.items() if tag not in _OP_TAGS and tag not in _PEER_TAGS}

Decoder = Callable[[Any], Any]


def _fail(what: str, value: Any) -> DecodeError:
    return DecodeError(f"expected {what}, got {type(value).__name__}")


def _int(value: Any) -> int:
    if type(value) is not int:
        raise _fail("an integer", value)
    return value


def _str(value: Any) -> str:
    if type(value) is not str:
        raise _fail("a string", value)
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _fail("a boolean", value)
    return value


def _bytes(value: Any) -> bytes:
    if type(value) is not bytes:
        raise _fail("bytes", value)
    return value


def _mem(value: Any) -> o.Mem:
    if type(value) is not list or len(value) != 2:
        raise _fail("a [buf, offset] pair", value)
    return o.Mem(_int(value[0]), _int(value[1]))


def _info(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail("a map", value)
    return value


def _enum(cls: type[enum.Enum]) -> Decoder:
    members = cls._value2member_map_  # a plain dict: Enum.__call__ is slow on the hot path

    def decode(value: Any) -> enum.Enum:
        member = members.get(_str(value))
        if member is None:
            raise DecodeError(f"{str(value)[:40]!r} is not a {cls.__name__}")
        return member

    return decode


def _enum_beside_text(hint: Any) -> type[enum.Enum] | None:
    """The enum of a hint `SomeEnum | str` (see messages.Error), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType) or len(args) != 2 or str not in args:
        return None
    (other,) = [a for a in args if a is not str]
    return other if isinstance(other, type) and issubclass(other, enum.Enum) else None


def _optional(inner: Decoder) -> Decoder:
    return lambda value: None if value is None else inner(value)


def _tuple_of(inner: Decoder) -> Decoder:
    def decode(value: Any) -> tuple[Any, ...]:
        if type(value) is not list:
            raise _fail("a list", value)
        return tuple(inner(item) for item in value)

    return decode


def _op(value: Any) -> o.Op:
    if type(value) is not dict or value.get("t") not in _OP_TAGS:
        raise DecodeError("expected an op")
    return typing.cast(o.Op, _from_map(value))


_SIMPLE: dict[Any, Decoder] = {
    int: _int, str: _str, bool: _bool, bytes: _bytes, o.Mem: _mem, dict[str, Any]: _info,
}


def _decoder_for(hint: Any) -> Decoder:
    if hint in _SIMPLE:
        return _SIMPLE[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint)
    if _enum_beside_text(hint) is not None:
        # (a string: the message's constructor makes it the member it names, if one, as it
        # does for a message built here: messages.member_or_name)
        return _str
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _optional(_decoder_for(inner))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _tuple_of(_op if args[0] == o.Op else _decoder_for(args[0]))
    raise TypeError(f"no decoder for {hint!r}")  # a schema bug, caught at import


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    decode: Decoder
    required: bool


def _schema(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(
        _Field(
            f.name,
            _decoder_for(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )


_SCHEMAS: dict[type, tuple[_Field, ...]] = {cls: _schema(cls) for cls in TAGS}
_ALLOWED: dict[type, frozenset[str]] = {
    cls: frozenset({"t", *(f.name for f in fields)}) for cls, fields in _SCHEMAS.items()
}


_ABSENT = object()


def _compile_decoder(cls: type, fields: tuple[_Field, ...]) -> Callable[[dict[Any, Any]], Any]:
    """A straight-line decoder for one message class, built once from its schema.

    The generic loop over fields cost half of a small call's decode time; the
    generated function does the same checks in the same order without it.
    """
    tag, allowed = TAGS[cls], _ALLOWED[cls]

    def unknown(raw: dict[Any, Any]) -> None:
        extra = sorted(str(k) for k in raw.keys() - allowed)
        raise DecodeError(f"{tag}: unknown field {extra[0][:40]!r}")

    def missing(name: str) -> None:
        raise DecodeError(f"{tag}: missing field {name!r}")

    namespace: dict[str, Any] = {"cls": cls, "allowed": allowed, "unknown": unknown,
                                 "missing": missing, "ABSENT": _ABSENT}
    lines = ["def decode(raw):", "    if not raw.keys() <= allowed:", "        unknown(raw)"]
    args = []
    for i, f in enumerate(fields):
        namespace[f"d{i}"] = f.decode
        if f.required:
            lines.append(f"    v{i} = raw[{f.name!r}] if {f.name!r} in raw else missing({f.name!r})")
            args.append(f"d{i}(v{i})")
        else:
            namespace[f"default{i}"] = next(x.default for x in dataclasses.fields(cls) if x.name == f.name)
            lines.append(f"    v{i} = raw.get({f.name!r}, ABSENT)")
            args.append(f"default{i} if v{i} is ABSENT else d{i}(v{i})")
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), namespace)
    return typing.cast(Callable[[dict[Any, Any]], Any], namespace["decode"])


_DECODERS: dict[type, Callable[[dict[Any, Any]], Any]] = {
    cls: _compile_decoder(cls, fields) for cls, fields in _SCHEMAS.items()
}


def _from_map(raw: dict[Any, Any], by_tag: dict[str, type] = _BY_TAG) -> Any:
    cls = by_tag.get(raw.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise DecodeError(f"unknown message type {str(raw.get('t'))[:40]!r}")
    return _DECODERS[cls](raw)


Encoder = Callable[[Any], Any] | None  # None: the value goes on the wire as it is


def _encoder_for(hint: Any) -> Encoder:
    if hint in _SIMPLE:
        return (lambda v: [v.buf, v.offset]) if hint is o.Mem else None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: v._value_
    if _enum_beside_text(hint) is not None:
        return lambda v: v if type(v) is str else v._value_
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        enc = _encoder_for(inner)
        return None if enc is None else (lambda v: None if v is None else enc(v))
    if args[0] == o.Op:
        return lambda v: [_to_wire(op) for op in v]
    return list


_ENCODERS: dict[type, tuple[tuple[str, Encoder], ...]] = {
    cls: tuple((f.name, _encoder_for(typing.get_type_hints(cls)[f.name]))
               for f in dataclasses.fields(cls))
    for cls in TAGS
}


def _to_wire(msg: Any) -> dict[str, Any]:
    cls = type(msg)
    out: dict[str, Any] = {"t": TAGS[cls]}
    for name, enc in _ENCODERS[cls]:
        value = getattr(msg, name)
        out[name] = value if enc is None else enc(value)
    return out


def _pack_ops(ops: tuple[o.Op, ...], packed: PackedOps) -> bytes:
    parts = []
    for op in ops:
        entry = packed.get(id(op))
        if entry is None or entry[0] is not op:
            if len(packed) >= OPS_CACHE_SIZE:
                packed.clear()
            entry = packed[id(op)] = (op, msgpack.packb(_to_wire(op), use_bin_type=True))
        parts.append(entry[1])
    header: bytes = msgpack.Packer().pack_array_header(len(ops))
    return header + b"".join(parts)


def _ops_bytes(data: bytes, request_id: Any) -> bytes | None:
    """What follows the id in a canonical Submit packet (t, id, ops, epoch in that order):
    the encoded ops array, then the epoch."""
    if type(request_id) is not int:
        return None
    head = _SUBMIT_HEAD + msgpack.packb(request_id) + _OPS_KEY
    return data[len(head):] if data.startswith(head) else None


def _plain_ok(data: bytes) -> m.Ok | None:
    """A plain Ok's id, when the packet is exactly head + uint + tail; else None (generic path)."""
    middle = data[len(_OK_HEAD):len(data) - len(_OK_TAIL)]
    try:
        request_id = msgpack.unpackb(middle)
    except Exception:  # not a single msgpack value: let the generic path explain
        return None
    if type(request_id) is not int or request_id <= 0 or request_id > U64_MAX:
        return None
    return m.Ok(request_id)


def _cached_submit(data: bytes, cache: OpsCache) -> m.Submit | None:
    """A Submit packet whose bytes after its id are a cached key, read without unpacking
    it: only the id, which follows the head in the shortest form msgpack writes, is new.
    Anything else (a longer form, a miss) is left to the generic path."""
    if len(data) <= _ID_AT:
        return None
    first = data[_ID_AT]
    if first < 0x80:  # (a positive fixint)
        request_id, end = first, _ID_AT + 1
    else:
        form = _UINT_FORMS.get(first)
        if form is None:
            return None
        width, least = form
        end = _ID_AT + 1 + width
        request_id = int.from_bytes(data[_ID_AT + 1:end])
        if request_id < least:  # (also where the packet ends before the id's bytes)
            return None
    if not data.startswith(_OPS_KEY, end):
        return None
    hit = cache.get(data[end + _OPS_KEY_BYTES:])
    return None if hit is None else m.Submit(request_id, *hit)


def _remember_ops(data: bytes, msg: m.Submit, cache: OpsCache) -> None:
    key = _ops_bytes(data, msg.id)
    if key is not None:
        # (summed only on a miss, which has just decoded a whole packet: a few µs more)
        if len(cache) >= OPS_CACHE_SIZE or sum(map(len, cache)) + len(key) > OPS_CACHE_BYTES:
            cache.clear()
        cache[key] = (msg.ops, msg.epoch)


def expected_fds(msg: m.Message) -> int:
    """How many fds must ride beside this message's packet."""
    if isinstance(msg, m.Import):
        return 1 if msg.kind.carries_fd else 0
    if isinstance(msg, m.Ok):
        return msg.nfds
    return 0


# The two packets of every call's steady state, done without the generic walk: a plain
# Ok is the daemon's most frequent reply, and a Submit's ops repeat byte for byte when a
# worker repeats a call. Both produce exactly what the generic path does (tests check).
_OK_HEAD = b"\x84\xa1t\xa2ok\xa2id"
_OK_TAIL = b"\xa5value\x00\xa4nfds\x00"
_SUBMIT_HEAD = b"\x84\xa1t\xa6submit\xa2id"
_OPS_KEY = b"\xa3ops"
_EPOCH_KEY = b"\xa5epoch"
_ID_AT = len(_SUBMIT_HEAD)
_OPS_KEY_BYTES = len(_OPS_KEY)
# msgpack's unsigned forms past a fixint: their marker -> (bytes, the least value that
# needs them); a value under it written in a longer form is valid, but not canonical
_UINT_FORMS = {0xCC: (1, 0x80), 0xCD: (2, 0x100), 0xCE: (4, 0x10000), 0xCF: (8, 0x100000000)}
OPS_CACHE_SIZE = 256
# ... and their bytes: a key is up to a whole packet, and its ops take several times that
# decoded; 256 distinct 64 KiB groups held ~37 MiB of the daemon's memory per connection
OPS_CACHE_BYTES = 1 << 20

# the encoded ops array and epoch -> the ops and epoch they decoded to
OpsCache = dict[bytes, tuple[tuple[o.Op, ...], int]]


PackedOps = dict[int, tuple[o.Op, bytes]]  # id(op) -> (the op, kept alive; its encoding)


def encode(msg: m.Message, limit: int = MAX_MESSAGE_BYTES,
           packed_ops: PackedOps | None = None) -> bytes:
    """Serialize one message; refuse one that would exceed `limit` bytes.

    With `packed_ops` (one per connection), the encoding of each op object is
    kept and reused: a worker repeating a call sends the same op objects.
    """
    if type(msg) is m.Ok and not msg.value and not msg.nfds:
        request_id: bytes = msgpack.packb(msg.id)
        return _OK_HEAD + request_id + _OK_TAIL
    if packed_ops is not None and type(msg) is m.Submit:
        request_id = msgpack.packb(msg.id)
        epoch: bytes = msgpack.packb(msg.epoch)
        packet = _SUBMIT_HEAD + request_id + _OPS_KEY + _pack_ops(msg.ops, packed_ops) + _EPOCH_KEY + epoch
        if len(packet) > limit:
            raise MessageTooLarge(f"submit is {len(packet)} bytes, over the {limit}-byte limit")
        return packet
    if type(msg) not in TAGS or isinstance(msg, (o.OP_TYPES, p.PEER_MESSAGES)):
        raise InvalidMessage(f"{type(msg).__name__} is not a message")
    return _pack(msg, limit)


def _pack(msg: m.Message | p.PeerMessage, limit: int) -> bytes:
    try:
        data: bytes = msgpack.packb(_to_wire(msg), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a StatusReport value msgpack lacks
        raise InvalidMessage(f"{TAGS[type(msg)]} cannot be encoded: {exc}") from exc
    if len(data) > limit:
        raise MessageTooLarge(f"{TAGS[type(msg)]} is {len(data)} bytes, over the {limit}-byte limit")
    return data


def decode(data: bytes, nfds: int = 0, limit: int = MAX_MESSAGE_BYTES,
           ops_cache: OpsCache | None = None) -> m.Message:
    """Parse one packet that arrived with `nfds` file descriptors.

    With `ops_cache` (one per connection), a Submit whose ops bytes were seen
    before reuses the ops decoded then: equal bytes decode to equal ops.
    """
    if len(data) > limit:
        raise MessageTooLarge(f"packet of {len(data)} bytes is over the {limit}-byte limit")
    if data.startswith(_OK_HEAD) and data.endswith(_OK_TAIL) and not nfds:
        ok = _plain_ok(data)
        if ok is not None:
            return ok
    if ops_cache is not None and not nfds and data.startswith(_SUBMIT_HEAD):
        cached = _cached_submit(data, ops_cache)  # (a Submit carries no fd: none is checked)
        if cached is not None:
            return cached
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if type(raw) is not dict:
            raise DecodeError("a message is a msgpack map")
        msg = _from_map(raw, _MESSAGE_TAGS)
        # Only a map of four distinct keys: a repeated one (the last value wins) may put
        # another id or no epoch behind the cached bytes, which the cache would not see
        if ops_cache is not None and type(msg) is m.Submit and len(raw) == 4:
            _remember_ops(data, msg, ops_cache)
    except ProtoError:
        raise
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise DecodeError(f"undecodable packet: {type(exc).__name__}: {str(exc)[:200]}") from None
    want = expected_fds(msg)
    if want != nfds:
        raise DecodeError(f"{TAGS[type(msg)]} needs {want} fd(s), the packet carried {nfds}")
    return typing.cast(m.Message, msg)


def encode_peer(msg: p.PeerMessage) -> bytes:
    """The header of a peer frame (proto/peerframe.py): of a sealed one, at most
    MAX_SEALED_HEADER_BYTES (a handshake's, in the clear, are far below MAX_MESSAGE_BYTES)."""
    if not isinstance(msg, p.PEER_MESSAGES):
        raise InvalidMessage(f"{type(msg).__name__} is not a peer message")
    return _pack(msg, pf.MAX_SEALED_HEADER_BYTES)


def decode_peer(data: bytes) -> p.PeerMessage:
    """Parse a peer frame's header; only peer messages are accepted here."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if type(raw) is not dict:
            raise DecodeError("a message is a msgpack map")
        if raw.get("t") == "peer_hello" and raw.get("version") != p.PEER_VERSION:
            # Another version's hello (a newer build's may have fields this one lacks, or its
            # incarnation of another form) must still decode, so that the listener refuses it by
            # its version in words: one it cannot read it drops without a word, which the dialer
            # takes for a listener too busy to answer. WIRE.md §9 promises the form of version,
            # daemon and nonce alone, which the refusal reads; an incarnation of another form goes.
            raw = {key: value for key, value in raw.items() if key in _ALLOWED[p.PeerHello]}
            incarnation = raw.get("incarnation", b"")
            if type(incarnation) is not bytes or len(incarnation) not in (0, p.INCARNATION_BYTES):
                del raw["incarnation"]
        return typing.cast(p.PeerMessage, _from_map(raw, _PEER_TAGS))
    except ProtoError:
        raise
    except Exception as exc:
        raise DecodeError(f"undecodable peer header: {type(exc).__name__}: {str(exc)[:200]}") from None
