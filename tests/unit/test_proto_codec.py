"""The codec: round trips of every message, the exact wire shape, and every way decoding refuses."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import proto
from proto import (
    AllGather,
    AllReduce,
    Barrier,
    Broadcast,
    DecodeError,
    Deregister,
    DType,
    Error,
    ErrorCode,
    Event,
    EventKind,
    Forget,
    Hello,
    Import,
    InvalidMessage,
    Mem,
    MemKind,
    MessageTooLarge,
    Ok,
    ProtoError,
    Reconnect,
    Recv,
    ReduceOp,
    ReduceScatter,
    Register,
    Send,
    SetAddKernel,
    StatusQuery,
    StatusReport,
    StreamEvents,
    StreamSubmit,
    Submit,
    SymAlloc,
    SymFree,
    Welcome,
    decode,
    encode,
    expected_fds,
    fields,
)
from proto.codec import TAGS
from proto.fields import MAX_RANKS, MAX_WORLD_NAME, U64_MAX
from proto.messages import DEVICE_UUID_BYTES
from proto.ops import OP_TYPES
from proto.peer import PEER_MESSAGES

pytestmark = pytest.mark.timeout(60)

WIRE_MD = Path(proto.__file__).with_name("WIRE.md")
# the Unix-socket messages; peer (TCP) messages have their own tests
MESSAGE_TYPES: tuple[type, ...] = tuple(cls for cls in TAGS if cls not in OP_TYPES
                                        and cls not in PEER_MESSAGES)
FAST = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def pack(raw: Any) -> bytes:
    data: bytes = msgpack.packb(raw, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def raises_exactly(cls: type[Exception], fn: Callable[[], object]) -> Exception:
    """`fn()` raises `cls` itself, not a subclass (DecodeError is not MessageTooLarge)."""
    with pytest.raises(cls) as info:
        fn()
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    return info.value


def roundtrip(msg: Any) -> Any:
    return decode(encode(msg), expected_fds(msg))


# ---- explicit examples ------------------------------------------------------------

M = Mem(3, 128)
ALL_OPS: tuple[Any, ...] = (
    AllReduce(M, 4096, DType.F32, ReduceOp.MAX),
    AllReduce(None, 0),
    AllGather(Mem(1, 0), Mem(2, 8), 24),
    AllGather(None, None, 0),
    ReduceScatter(Mem(1, 0), Mem(1, 4096), 16, DType.F64, ReduceOp.PROD),
    ReduceScatter(None, Mem(9, 0), 0),
    Broadcast(M, 100, 3),
    Broadcast(Mem(1, 4), 4, 0, command=True),
    Barrier(),
    Send(M, 7, 65535, stream=U64_MAX),
    Recv(Mem(U64_MAX, U64_MAX), 1, 0),
)

EXAMPLES: tuple[Any, ...] = (
    Hello(1, proto.PROTOCOL_VERSION, 4242, "job-17", 0, 2, 60_000),
    Hello(U64_MAX, U64_MAX, U64_MAX, "a" * MAX_WORLD_NAME, MAX_RANKS - 1, MAX_RANKS, U64_MAX,
          device=MAX_RANKS - 1, bootstrap="b" * 256, token="t" * 256),
    Hello(2, 1, 1, "Az09._:@/-", 3, 4, 1, device=0, bootstrap="10.0.0.1:29500", token=""),
    Import(2, 5, MemKind.HOST, 1 << 20),
    Import(3, 6, MemKind.CUDA_IPC, 4096, b"\x00\xff" * 32),
    Import(4, 7, MemKind.CUDA_VMM, 2 << 20, b"x" * 256),
    Forget((1,)),
    Forget(tuple(range(1, proto.MAX_GROUP_OPS + 1))),
    Submit(5, (AllReduce(Mem(1, 0), 8),)),
    Submit(6, ALL_OPS),
    StreamEvents(16, 0, b"\x01" * 64, b"\xfe" * 64),
    StreamEvents(17, U64_MAX, bytes(64), bytes(range(64))),
    StreamSubmit(18, (AllReduce(Mem(1, 0), 8),), 0),
    StreamSubmit(U64_MAX, ALL_OPS, U64_MAX, early=True),
    Register(7, M, 4096),
    Register(8, Mem(1, 0), 0),
    Deregister(9, 0),
    Deregister(10, U64_MAX),
    SymAlloc(11, 12, 1),
    SymFree(12, 12),
    SetAddKernel(13, 77),
    Reconnect(14),
    StatusQuery(15),
    Welcome(1, proto.PROTOCOL_VERSION, "0.1.0", "host", 1, proto.MAX_MESSAGE_BYTES),
    Welcome(U64_MAX, 0, "", "ñccl ☃", 0, 1),
    Ok(16),
    Ok(17, value=U64_MAX, nfds=1),
    Error(0, ErrorCode.BAD_MESSAGE, "bad packet"),
    Error(18, ErrorCode.VERSION, "x" * 4096),
    *(Error(19, code, code.value) for code in ErrorCode),
    Event(EventKind.WORLD_FAILED, ErrorCode.MISMATCH, "rank 1 called broadcast", 3),
    Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, ""),
    StatusReport(20, {}),
    StatusReport(21, {"connections": 2, "worlds": {"w": {"ranks": [0, 1], "cause": None}},
                      "load": 0.5, "raw": b"\x00", "neg": -3, "ok": True}),
)


ONE_OF_EACH: tuple[Any, ...] = tuple({type(msg): msg for msg in reversed(EXAMPLES)}.values())


def test_examples_cover_every_tag() -> None:
    seen = {type(msg) for msg in EXAMPLES} | {type(op) for op in ALL_OPS}
    assert seen == set(TAGS) - set(PEER_MESSAGES)
    assert set(MESSAGE_TYPES) == {type(msg) for msg in EXAMPLES}
    assert {type(op) for op in ALL_OPS} == set(OP_TYPES)
    assert len(TAGS) == len(set(TAGS.values())) == 25 + len(PEER_MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_roundtrip_examples(msg: Any) -> None:
    data = encode(msg)
    back = decode(data, expected_fds(msg))
    assert back == msg
    assert type(back) is type(msg)
    assert encode(back) == data  # the encoding is canonical
    raw = unpack(data)
    assert list(raw) == ["t", *(f.name for f in dataclasses.fields(msg))]  # every field, in order
    assert raw["t"] == TAGS[type(msg)]


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: type(o).__name__)
def test_roundtrip_each_op_alone(op: Any) -> None:
    assert roundtrip(Submit(1, (op,))) == Submit(1, (op,))


def test_wire_shape_of_fields() -> None:
    assert unpack(encode(Submit(7, (AllReduce(Mem(1, 2), 8, DType.F32, ReduceOp.MIN),), 4))) == {
        "t": "submit", "id": 7,
        "ops": [{"t": "all_reduce", "buf": [1, 2], "nbytes": 8, "dtype": "f32", "op": "min"}],
        "epoch": 4,
    }
    assert unpack(encode(Submit(1, (AllGather(None, None, 0), Barrier())))) == {
        "t": "submit", "id": 1,
        "ops": [{"t": "all_gather", "send": None, "recv": None, "nbytes": 0}, {"t": "barrier"}],
        "epoch": 0,
    }
    assert unpack(encode(Import(2, 3, MemKind.CUDA_IPC, 64, b"\x01\x02"))) == {
        "t": "import", "id": 2, "buf": 3, "kind": "cuda-ipc", "size": 64, "handle": b"\x01\x02",
    }
    assert unpack(encode(Hello(1, 1, 9, "w", 0, 1, 5))) == {
        "t": "hello", "id": 1, "version": 1, "pid": 9, "world": "w", "rank": 0, "world_size": 1,
        "timeout_ms": 5, "device": None, "bootstrap": None, "token": None, "epoch": 0, "device_uuid": b"",
    }
    assert unpack(encode(Forget((4, 5)))) == {"t": "forget", "bufs": [4, 5]}
    assert unpack(encode(Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, "bye"))) == {
        "t": "event", "kind": "shutdown", "code": "shutdown", "message": "bye", "epoch": 0,
    }
    assert unpack(encode(Submit(3, (Broadcast(Mem(1, 0), 4, 2, command=True),)))) == {
        "t": "submit", "id": 3,
        "ops": [{"t": "broadcast", "buf": [1, 0], "nbytes": 4, "root": 2, "command": True}],
        "epoch": 0,
    }


def test_bytes_travel_as_bin_and_text_as_str() -> None:
    data = encode(Import(2, 3, MemKind.CUDA_IPC, 64, b"ab"))
    assert b"\xc4\x02ab" in data  # bin8, length 2
    raw = msgpack.unpackb(data, raw=True)
    assert raw[b"kind"] == b"cuda-ipc"
    assert type(unpack(data)["kind"]) is str
    assert type(unpack(data)["handle"]) is bytes


def test_defaults_may_be_omitted_on_the_wire() -> None:
    assert decode(pack({"t": "ok", "id": 3})) == Ok(3, 0, 0)
    assert decode(pack({"t": "event", "kind": "shutdown", "code": "shutdown", "message": ""})) == Event(
        EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, "", 0)
    assert decode(pack({"t": "import", "id": 1, "buf": 1, "kind": "cuda-ipc", "size": 1})) == Import(
        1, 1, MemKind.CUDA_IPC, 1, b"")
    hello = {"t": "hello", "id": 1, "version": 1, "pid": 2, "world": "w", "rank": 0,
             "world_size": 1, "timeout_ms": 10}
    assert decode(pack(hello)) == Hello(1, 1, 2, "w", 0, 1, 10, None, None, None)
    submit = {"t": "submit", "id": 1, "ops": [
        {"t": "all_reduce", "buf": None, "nbytes": 0},
        {"t": "reduce_scatter", "send": None, "recv": None, "nbytes": 0},
        {"t": "broadcast", "buf": None, "nbytes": 0, "root": 0},
        {"t": "send", "buf": None, "nbytes": 0, "peer": 1},
        {"t": "recv", "buf": None, "nbytes": 0, "peer": 1},
    ]}
    assert decode(pack(submit)) == Submit(1, (
        AllReduce(None, 0, DType.BF16, ReduceOp.SUM),
        ReduceScatter(None, None, 0, DType.U8, ReduceOp.SUM),
        Broadcast(None, 0, 0, False),
        Send(None, 0, 1, 0),
        Recv(None, 0, 1, 0),
    ))


def test_largest_group_fits_the_packet_limit() -> None:
    op = ReduceScatter(Mem(U64_MAX, U64_MAX), Mem(U64_MAX, U64_MAX), U64_MAX - 1,
                       DType.BF16, ReduceOp.PROD)  # the longest names and integers an op can have
    msg = Submit(U64_MAX, (op,) * proto.MAX_GROUP_OPS, U64_MAX)
    data = encode(msg)
    assert len(data) == 51_756
    assert decode(data) == msg


# ---- WIRE.md stays in step with the code -------------------------------------------

WORKED = Submit(7, (AllReduce(Mem(1, 0), 4096, DType.F32, ReduceOp.SUM),), 1)
WORKED_HEX = (
    "84a174a67375626d6974a2696407a36f70739185a174aa616c6c5f726564756365a3627566920100"
    "a66e6279746573cd1000a56474797065a3663332a26f70a373756da565706f636801"
)


def test_worked_example_is_the_real_encoding() -> None:
    assert encode(WORKED).hex() == WORKED_HEX
    assert len(encode(WORKED)) == 74
    assert decode(bytes.fromhex(WORKED_HEX)) == WORKED
    assert WORKED_HEX in WIRE_MD.read_text()
    assert encode(Ok(7)).hex(" ") in WIRE_MD.read_text().replace("\n", " ")


def test_wire_md_names_every_tag_error_code_and_limit() -> None:
    text = WIRE_MD.read_text()
    for tag in TAGS.values():
        assert f"`{tag}`" in text, tag
    for enum_cls in (ErrorCode, DType, ReduceOp, MemKind, EventKind):
        for member in enum_cls:
            assert f"`{member.value}`" in text, member
    for cls in MESSAGE_TYPES:
        assert re.search(rf"^`{TAGS[cls]}` \(tag `{TAGS[cls]}`", text, re.M), cls
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, (cls, f.name)
    assert f"`PROTOCOL_VERSION = {proto.PROTOCOL_VERSION}`" in text
    assert f"| `MAX_GROUP_OPS` | {proto.MAX_GROUP_OPS} " in text
    assert f"| `DEVICE_UUID_BYTES` | {DEVICE_UUID_BYTES} " in text
    for name in ("MAX_MESSAGE_BYTES", "MAX_RANKS", "MAX_WORLD_NAME", "MAX_ERROR_TEXT", "MAX_ERROR_CODE"):
        assert f"| `{name}` | {getattr(fields, name)} " in text, name
    assert fields.MAX_HELLO_EPOCH == 1 << 62 and "| `MAX_HELLO_EPOCH` | 2⁶² " in text


# ---- hypothesis round trips --------------------------------------------------------

u64 = st.integers(0, U64_MAX)
pos = st.integers(1, U64_MAX)
ranks = st.integers(0, MAX_RANKS - 1)
mems = st.builds(Mem, pos, u64)
text = st.text(st.characters(codec="utf-8"), max_size=40)


@st.composite
def sized(draw: st.DrawFn, itemsize: int = 1) -> int:
    return draw(st.integers(0, U64_MAX // itemsize).map(lambda k: k * itemsize)
                | st.sampled_from([0, itemsize, 4096 * itemsize]))


def place(nbytes: int) -> st.SearchStrategy[Mem | None]:
    return mems if nbytes else st.none() | mems


@st.composite
def all_reduces(draw: st.DrawFn) -> AllReduce:
    dtype = draw(st.sampled_from(DType))
    nbytes = draw(sized(dtype.itemsize))
    return AllReduce(draw(place(nbytes)), nbytes, dtype, draw(st.sampled_from(ReduceOp)))


@st.composite
def all_gathers(draw: st.DrawFn) -> AllGather:
    nbytes = draw(sized())
    return AllGather(draw(place(nbytes)), draw(place(nbytes)), nbytes)


@st.composite
def reduce_scatters(draw: st.DrawFn) -> ReduceScatter:
    dtype = draw(st.sampled_from(DType))
    nbytes = draw(sized(dtype.itemsize))
    return ReduceScatter(draw(place(nbytes)), draw(place(nbytes)), nbytes, dtype,
                         draw(st.sampled_from(ReduceOp)))


@st.composite
def broadcasts(draw: st.DrawFn) -> Broadcast:
    command = draw(st.booleans())
    nbytes = 4 if command else draw(sized())
    return Broadcast(draw(place(nbytes)), nbytes, draw(ranks), command)


@st.composite
def p2ps(draw: st.DrawFn) -> Send | Recv:
    nbytes = draw(sized())
    cls: type[Send] | type[Recv] = Send if draw(st.booleans()) else Recv
    return cls(draw(place(nbytes)), nbytes, draw(ranks), draw(u64))


ops: st.SearchStrategy[Any] = st.one_of(
    all_reduces(), all_gathers(), reduce_scatters(), broadcasts(), st.just(Barrier()), p2ps())


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    world_size = draw(st.integers(1, MAX_RANKS))
    short = st.none() | st.text(st.characters(codec="utf-8"), max_size=256)
    return Hello(
        draw(pos), draw(u64), draw(u64),
        draw(st.from_regex(r"[A-Za-z0-9._:@/-]{1,128}", fullmatch=True)),
        draw(st.integers(0, world_size - 1)), world_size, draw(pos),
        draw(st.none() | ranks), draw(short), draw(short),
    )


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), U64_MAX)
    | st.floats(allow_nan=False) | text | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)

messages: st.SearchStrategy[Any] = st.one_of(
    hellos(),
    st.builds(Import, pos, pos, st.sampled_from(MemKind), pos, st.binary(max_size=256)),
    st.builds(Forget, st.lists(pos, min_size=1, max_size=32).map(tuple)),
    st.builds(Submit, pos, st.lists(ops, min_size=1, max_size=6).map(tuple)),
    st.builds(StreamEvents, pos, u64, st.binary(min_size=64, max_size=64),
              st.binary(min_size=64, max_size=64)),
    st.builds(StreamSubmit, pos, st.lists(ops, min_size=1, max_size=6).map(tuple), u64, st.booleans()),
    st.builds(Register, pos, mems, u64),
    st.builds(Deregister, pos, u64),
    st.builds(SymAlloc, pos, pos, pos),
    st.builds(SymFree, pos, pos),
    st.builds(SetAddKernel, pos, u64),
    st.builds(Reconnect, pos),
    st.builds(StatusQuery, pos),
    st.builds(Welcome, pos, u64, text, text, u64, pos),
    st.builds(Ok, pos, u64, st.integers(0, 1)),
    st.builds(Error, u64, st.sampled_from(ErrorCode), text),
    st.builds(Event, st.sampled_from(EventKind), st.sampled_from(ErrorCode), text, u64),
    st.builds(StatusReport, pos, st.dictionaries(text, json_like, max_size=5)),
)


@FAST
@given(msg=messages)
def test_roundtrip_hypothesis(msg: Any) -> None:
    data = encode(msg)
    back = decode(data, expected_fds(msg))
    assert back == msg
    assert type(back) is type(msg)
    assert encode(back) == data


@FAST
@given(op=ops)
def test_roundtrip_ops_hypothesis(op: Any) -> None:
    msg = Submit(1, (op, op))
    assert roundtrip(msg) == msg
    assert unpack(encode(msg))["ops"][0]["t"] == TAGS[type(op)]


# ---- decode errors: schema -----------------------------------------------------------

def raw_of(msg: Any) -> dict[str, Any]:
    raw: dict[str, Any] = unpack(encode(msg))
    return raw


@pytest.mark.parametrize("tag", ["nope", "", "Hello", "status_query", "op", None, 1, b"hello", [1]])
def test_unknown_tag(tag: Any) -> None:
    err = raises_exactly(DecodeError, lambda: decode(pack({"t": tag, "id": 1})))
    assert isinstance(err, ProtoError)


def test_missing_tag() -> None:
    assert "unknown message type" in str(raises_exactly(DecodeError, lambda: decode(pack({"id": 1}))))
    raises_exactly(DecodeError, lambda: decode(pack({})))


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: type(o).__name__)
def test_op_is_not_a_top_level_message(op: Any) -> None:
    raw = raw_of(Submit(1, (op,)))["ops"][0]
    err = raises_exactly(DecodeError, lambda: decode(pack(raw)))
    assert "unknown message type" in str(err)
    raises_exactly(InvalidMessage, lambda: encode(op))


def test_only_ops_inside_submit() -> None:
    hello = raw_of(EXAMPLES[0])
    for bad in (hello, {"t": "nope"}, {"t": "ok", "id": 1}, [1, 2], 5, None, "barrier"):
        err = raises_exactly(DecodeError, partial(decode, pack({"t": "submit", "id": 1, "ops": [bad]})))
        assert "expected an op" in str(err)


def _required(msg: Any) -> list[tuple[Any, str]]:
    return [(msg, f.name) for f in dataclasses.fields(msg)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


@pytest.mark.parametrize(("msg", "name"), [pair for m in ONE_OF_EACH for pair in _required(m)],
                         ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_missing_field(msg: Any, name: str) -> None:
    raw = raw_of(msg)
    del raw[name]
    err = raises_exactly(DecodeError, lambda: decode(pack(raw), expected_fds(msg)))
    assert f"missing field {name!r}" in str(err)


@pytest.mark.parametrize(("op", "name"), [pair for o in ALL_OPS for pair in _required(o)],
                         ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_missing_field_in_op(op: Any, name: str) -> None:
    raw = raw_of(Submit(1, (op,)))
    del raw["ops"][0][name]
    err = raises_exactly(DecodeError, lambda: decode(pack(raw)))
    assert f"{TAGS[type(op)]}: missing field {name!r}" in str(err)


def test_optional_without_default_is_still_required() -> None:
    raises_exactly(DecodeError, lambda: decode(pack({"t": "submit", "id": 1, "ops": [
        {"t": "all_reduce", "nbytes": 0}]})))
    assert decode(pack({"t": "submit", "id": 1, "ops": [
        {"t": "all_reduce", "buf": None, "nbytes": 0}]})) == Submit(1, (AllReduce(None, 0),))


@pytest.mark.parametrize("msg", ONE_OF_EACH, ids=lambda m: type(m).__name__)
def test_unknown_field(msg: Any) -> None:
    raw = raw_of(msg)
    raw["zz"] = 1
    err = raises_exactly(DecodeError, lambda: decode(pack(raw), expected_fds(msg)))
    assert "unknown field 'zz'" in str(err)


def test_unknown_field_in_op_and_bytes_key() -> None:
    raw = raw_of(Submit(1, (Barrier(),)))
    raw["ops"][0]["root"] = 0
    assert "barrier: unknown field 'root'" in str(raises_exactly(DecodeError, lambda: decode(pack(raw))))
    raw = raw_of(StatusQuery(1))
    raw[b"id"] = 1  # type: ignore[index]
    raises_exactly(DecodeError, lambda: decode(pack(raw)))


WRONG_TYPES: list[tuple[Any, str, Any]] = [
    (StatusQuery(1), "id", True),  # bool where int
    (StatusQuery(1), "id", False),
    (StatusQuery(1), "id", 1.0),  # float where int
    (StatusQuery(1), "id", "1"),
    (StatusQuery(1), "id", None),  # nil where a required int
    (StatusQuery(1), "id", [1]),
    (Ok(1), "nfds", True),
    (Import(1, 1, MemKind.CUDA_IPC, 1), "handle", "abc"),  # str where bytes
    (Import(1, 1, MemKind.CUDA_IPC, 1), "handle", None),
    (Import(1, 1, MemKind.CUDA_IPC, 1), "handle", [1, 2]),
    (Import(1, 1, MemKind.CUDA_IPC, 1), "kind", "gpu"),  # not a member
    (Import(1, 1, MemKind.CUDA_IPC, 1), "kind", "HOST"),
    (Import(1, 1, MemKind.CUDA_IPC, 1), "kind", b"host"),  # bytes where an enum string
    (Import(1, 1, MemKind.CUDA_IPC, 1), "kind", 0),
    (Hello(1, 1, 1, "w", 0, 1, 1), "world", b"w"),  # bytes where str
    (Hello(1, 1, 1, "w", 0, 1, 1), "world", 7),
    (Hello(1, 1, 1, "w", 0, 1, 1), "device", True),  # bool where int | None
    (Hello(1, 1, 1, "w", 0, 1, 1), "device", "0"),
    (Hello(1, 1, 1, "w", 0, 1, 1), "token", b"tok"),
    (Forget((1,)), "bufs", 1),  # int where list
    (Forget((1,)), "bufs", [True]),
    (Forget((1,)), "bufs", {"a": 1}),
    (Forget((1,)), "bufs", [1, "2"]),
    (Register(1, Mem(1, 0), 1), "buf", [1]),  # Mem with the wrong arity
    (Register(1, Mem(1, 0), 1), "buf", [1, 2, 3]),
    (Register(1, Mem(1, 0), 1), "buf", {"buf": 1, "offset": 0}),
    (Register(1, Mem(1, 0), 1), "buf", [True, 0]),
    (Register(1, Mem(1, 0), 1), "buf", [1, 0.0]),
    (Register(1, Mem(1, 0), 1), "buf", None),  # Mem is not optional here
    (Register(1, Mem(1, 0), 1), "buf", 1),
    (Error(1, ErrorCode.MISUSE, "m"), "code", 7),  # (a string it lacks is a newer peer's code)
    (Error(1, ErrorCode.MISUSE, "m"), "code", b"misuse"),
    (Error(1, ErrorCode.MISUSE, "m"), "message", b"m"),
    (Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, "m"), "kind", 1),  # (a string it lacks is a newer kind)
    (Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, "m"), "kind", b"shutdown"),
    (StatusReport(1, {}), "info", [1]),
    (StatusReport(1, {}), "info", None),
    (Submit(1, (Barrier(),)), "ops", {"t": "barrier"}),
    (Welcome(1, 1, "v", "e", 0, 1), "daemon_version", None),
]


@pytest.mark.parametrize(("msg", "name", "value"), WRONG_TYPES,
                         ids=[f"{type(m).__name__}.{n}={v!r}" for m, n, v in WRONG_TYPES])
def test_wrong_field_type(msg: Any, name: str, value: Any) -> None:
    raw = raw_of(msg)
    raw[name] = value
    err = raises_exactly(DecodeError, lambda: decode(pack(raw), expected_fds(msg)))
    assert "expected" in str(err) or "is not a" in str(err)


@pytest.mark.parametrize(("name", "value"), [
    ("nbytes", True), ("nbytes", 1.5), ("dtype", "float32"), ("dtype", 4), ("op", "avg"),
    ("buf", [1, -0.0]), ("buf", "x"),
])
def test_wrong_field_type_in_op(name: str, value: Any) -> None:
    raw = raw_of(Submit(1, (AllReduce(Mem(1, 0), 8),)))
    raw["ops"][0][name] = value
    raises_exactly(DecodeError, lambda: decode(pack(raw)))


def test_broadcast_command_must_be_bool() -> None:
    raw = raw_of(Submit(1, (Broadcast(Mem(1, 0), 4, 0, command=True),)))
    raw["ops"][0]["command"] = 1
    raises_exactly(DecodeError, lambda: decode(pack(raw)))


# ---- decode errors: fds, size, framing -----------------------------------------------

@pytest.mark.parametrize(("msg", "want"), [
    (Import(1, 1, MemKind.HOST, 8), 1),
    (Import(1, 1, MemKind.CUDA_VMM, 8), 1),
    (Import(1, 1, MemKind.CUDA_IPC, 8, b"h" * 64), 0),
    (Ok(1, nfds=1), 1),
    (Ok(1), 0),
    (Submit(1, (Barrier(),)), 0),
    (Hello(1, 1, 1, "w", 0, 1, 1), 0),
    (Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, ""), 0),
])
def test_fd_count(msg: Any, want: int) -> None:
    assert expected_fds(msg) == want
    data = encode(msg)
    assert decode(data, want) == msg
    for wrong in {0, 1, 2, 253} - {want}:
        err = raises_exactly(DecodeError, partial(decode, data, wrong))
        assert f"needs {want} fd(s), the packet carried {wrong}" in str(err)


def test_oversized_packet() -> None:
    limit = proto.MAX_MESSAGE_BYTES
    raises_exactly(MessageTooLarge, lambda: decode(b"\x00" * (limit + 1)))
    big = StatusReport(1, {"blob": b"x" * (limit - 100)})
    data = encode(big)
    assert len(data) <= limit
    assert decode(data) == big
    padded = StatusReport(1, {"blob": b"x" * limit})
    raises_exactly(MessageTooLarge, lambda: encode(padded))
    raw = pack(raw_of(big) | {"info": {"blob": b"x" * limit}})
    err = raises_exactly(MessageTooLarge, lambda: decode(raw))
    assert isinstance(err, DecodeError)


def test_size_limit_is_inclusive_and_adjustable() -> None:
    data = encode(WORKED)
    assert decode(data, limit=len(data)) == WORKED
    raises_exactly(MessageTooLarge, lambda: decode(data, limit=len(data) - 1))
    assert encode(WORKED, limit=len(data)) == data
    raises_exactly(MessageTooLarge, lambda: encode(WORKED, limit=len(data) - 1))
    long_error = Error(1, ErrorCode.INTERNAL, "\U0010ffff" * 4096)  # 4 UTF-8 bytes a character
    assert len(encode(long_error)) > 4 * 4096
    assert roundtrip(long_error) == long_error


def test_an_error_keeps_a_code_it_does_not_know_and_clips_a_long_message() -> None:
    """WIRE.md §7: an error refuses one request; a newer peer's code, or a message over
    4096 characters, must not make it a bad packet (which costs the connection)."""
    raw = {"t": "error", "id": 3, "code": "quota_exceeded", "message": "over quota"}
    newer = decode(pack(raw))
    assert newer == Error(3, "quota_exceeded", "over quota") and newer.code == "quota_exceeded"
    assert unpack(encode(newer)) == raw
    assert Error(3, "misuse", "m") == Error(3, ErrorCode.MISUSE, "m")  # a code it knows is the member
    long = decode(pack(raw | {"code": "misuse", "message": "y" * 4000 + "z" * 60_000}))
    assert long.code is ErrorCode.MISUSE
    assert long.message == "y" * 4000 + "z" * 76 + " ... (cut)" and len(long.message) == 4086
    assert roundtrip(long) == long
    edge = "c" * proto.MAX_ERROR_CODE
    assert decode(pack(raw | {"code": edge, "message": "x" * 4096})) == Error(3, edge, "x" * 4096)


def test_an_event_keeps_a_code_it_does_not_know_and_clips_a_long_message() -> None:
    """WIRE.md §7, as for an error: what the event says happened must not be lost to a bad
    packet (which costs the connection, and with it the world)."""
    raw = {"t": "event", "kind": "world_failed", "code": "quota_exceeded", "message": "over", "epoch": 3}
    newer = decode(pack(raw))
    assert newer == Event(EventKind.WORLD_FAILED, "quota_exceeded", "over", 3)
    assert newer.code == "quota_exceeded" and unpack(encode(newer)) == raw
    assert Event(EventKind.SHUTDOWN, "shutdown", "m") == Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, "m")
    long = decode(pack(raw | {"code": "peer_lost", "message": "y" * 4000 + "z" * 60_000}))
    assert long.code is ErrorCode.PEER_LOST and long.epoch == 3
    assert long.message == "y" * 4000 + "z" * 76 + " ... (cut)" and roundtrip(long) == long
    edge = "c" * proto.MAX_ERROR_CODE
    assert decode(pack(raw | {"code": edge, "message": "x" * 4096})) == Event(
        EventKind.WORLD_FAILED, edge, "x" * 4096, 3)


def test_an_event_of_a_kind_it_does_not_know_keeps_the_kind_as_its_string() -> None:
    """WIRE.md §7: a newer daemon's kind of notice is the client's to ignore, not a bad packet."""
    raw = {"t": "event", "kind": "quota_warning", "code": "quota_exceeded", "message": "m", "epoch": 0}
    newer = decode(pack(raw))
    assert newer == Event("quota_warning", "quota_exceeded", "m") and newer.kind == "quota_warning"
    assert unpack(encode(newer)) == raw
    assert Event("world_failed", ErrorCode.PEER_LOST, "m").kind is EventKind.WORLD_FAILED
    edge = "k" * proto.MAX_ERROR_CODE
    assert decode(pack(raw | {"kind": edge})).kind == edge


@pytest.mark.parametrize("value", [[], [1, 2], 0, -1, None, True, "submit", b"\x81", 1.5])
def test_non_map_top_level(value: Any) -> None:
    err = raises_exactly(DecodeError, lambda: decode(pack(value)))
    assert "msgpack map" in str(err)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x81", b"\x82\xa1t", b"\xdf\xff\xff\xff\xff",  # empty, reserved byte, truncated
    encode(Ok(1))[:-1],
    encode(Ok(1)) + b"\x00",  # two objects in one packet
    encode(Ok(1)) + encode(Ok(2)),
    b"\x91" * 5000 + b"\xc0",  # deeper than msgpack's stack
    pack({1: 2}),  # a non-string key
])
def test_undecodable_bytes(data: bytes) -> None:
    raises_exactly(DecodeError, lambda: decode(data))


# ---- invalid values --------------------------------------------------------------------

def _submit_raw(op: dict[str, Any]) -> dict[str, Any]:
    return {"t": "submit", "id": 1, "ops": [op]}


INVALID_RAW: list[dict[str, Any]] = [
    _submit_raw({"t": "all_reduce", "buf": [1, 0], "nbytes": 6, "dtype": "f32"}),  # not a multiple of 4
    _submit_raw({"t": "all_reduce", "buf": [1, 0], "nbytes": 1}),  # bf16 by default
    _submit_raw({"t": "reduce_scatter", "send": [1, 0], "recv": [1, 8], "nbytes": 12, "dtype": "f64"}),
    _submit_raw({"t": "all_reduce", "buf": None, "nbytes": 8}),  # bytes but no place
    _submit_raw({"t": "all_gather", "send": [1, 0], "recv": None, "nbytes": 1}),
    _submit_raw({"t": "send", "buf": None, "nbytes": 1, "peer": 0}),
    _submit_raw({"t": "broadcast", "buf": [1, 0], "nbytes": 8, "root": 0, "command": True}),
    _submit_raw({"t": "broadcast", "buf": [1, 0], "nbytes": 8, "root": MAX_RANKS}),
    _submit_raw({"t": "recv", "buf": [1, 0], "nbytes": 8, "peer": -1}),
    _submit_raw({"t": "send", "buf": [1, 0], "nbytes": 8, "peer": 0, "stream": -1}),
    _submit_raw({"t": "all_reduce", "buf": [0, 0], "nbytes": 0}),  # buffer ids start at 1
    _submit_raw({"t": "all_reduce", "buf": [1, -1], "nbytes": 0}),
    _submit_raw({"t": "all_reduce", "buf": [1, 0], "nbytes": -2}),
    {"t": "submit", "id": 1, "ops": []},
    {"t": "submit", "id": 1, "ops": [{"t": "barrier"}] * (proto.MAX_GROUP_OPS + 1)},
    {"t": "submit", "id": 0, "ops": [{"t": "barrier"}]},
    {"t": "submit", "id": -1, "ops": [{"t": "barrier"}]},
    {"t": "status", "id": 0},
    {"t": "status", "id": -(1 << 63)},
    {"t": "reconnect", "id": -5},
    {"t": "ok", "id": 1, "nfds": 2},
    {"t": "ok", "id": 1, "value": -1},
    {"t": "error", "id": -1, "code": "misuse", "message": ""},
    {"t": "error", "id": 1, "code": "", "message": ""},
    {"t": "error", "id": 1, "code": "c" * (proto.MAX_ERROR_CODE + 1), "message": ""},
    {"t": "event", "kind": "shutdown", "code": "shutdown", "message": "", "epoch": -1},
    {"t": "event", "kind": "shutdown", "code": "", "message": ""},
    {"t": "event", "kind": "", "code": "shutdown", "message": ""},
    {"t": "event", "kind": "k" * (proto.MAX_ERROR_CODE + 1), "code": "shutdown", "message": ""},
    {"t": "event", "kind": "shutdown", "code": "c" * (proto.MAX_ERROR_CODE + 1), "message": ""},
    {"t": "forget", "bufs": []},
    {"t": "forget", "bufs": [0]},
    {"t": "forget", "bufs": list(range(1, proto.MAX_GROUP_OPS + 2))},
    {"t": "import", "id": 1, "buf": 1, "kind": "cuda-ipc", "size": 0},
    {"t": "import", "id": 1, "buf": 0, "kind": "cuda-ipc", "size": 1},
    {"t": "import", "id": 1, "buf": 1, "kind": "cuda-ipc", "size": 1, "handle": b"h" * 257},
    {"t": "register", "id": 1, "buf": [1, 0], "nbytes": -1},
    {"t": "deregister", "id": 1, "handle": -1},
    {"t": "sym_alloc", "id": 1, "buf": 1, "nbytes": 0},
    {"t": "sym_free", "id": 1, "buf": 0},
    {"t": "set_add_kernel", "id": 1, "handle": -1},
    {"t": "welcome", "id": 1, "version": 1, "daemon_version": "", "engine": "", "epoch": 0, "max_message": 0},
    {"t": "welcome", "id": 1, "version": -1, "daemon_version": "", "engine": "", "epoch": 0,
     "max_message": 1},
    {"t": "status_report", "id": 0, "info": {}},
]

HELLO_RAW = {"t": "hello", "id": 1, "version": 1, "pid": 1, "world": "w", "rank": 0,
             "world_size": 2, "timeout_ms": 1000}
INVALID_HELLO: list[dict[str, Any]] = [
    {"rank": 2},  # rank >= world_size
    {"rank": 5, "world_size": 5},
    {"rank": -1},
    {"world_size": 0, "rank": 0},
    {"world_size": MAX_RANKS + 1},
    {"world": ""},
    {"world": "a b"},
    {"world": "w\n"},
    {"world": "wörld"},
    {"world": "a" * (MAX_WORLD_NAME + 1)},
    {"world": "job;rm"},
    {"id": 0},
    {"version": -1},
    {"pid": -1},
    {"timeout_ms": 0},
    {"device": -1},
    {"device": MAX_RANKS},
    {"bootstrap": "b" * 257},
    {"token": "t" * 257},
]


@pytest.mark.parametrize("raw", INVALID_RAW + [HELLO_RAW | d for d in INVALID_HELLO],
                         ids=lambda r: str(r)[:60])
def test_invalid_values(raw: dict[str, Any]) -> None:
    data = pack(raw)
    err = raises_exactly(InvalidMessage, lambda: decode(data))
    assert isinstance(err, ProtoError)
    assert isinstance(err, ValueError)


def test_hello_boundaries_are_valid() -> None:
    for extra in ({"rank": 1}, {"world": "a" * MAX_WORLD_NAME}, {"world_size": MAX_RANKS, "rank": 0},
                  {"device": MAX_RANKS - 1}, {"bootstrap": "b" * 256}, {"token": ""}):
        raw = HELLO_RAW | extra
        msg = decode(pack(raw))
        assert isinstance(msg, Hello)
        assert all(getattr(msg, k) == v for k, v in extra.items())


@pytest.mark.parametrize("build", [
    lambda: Mem(0, 0),
    lambda: Mem(1, U64_MAX + 1),
    lambda: Mem(U64_MAX + 1, 0),
    lambda: AllReduce(Mem(1, 0), 3, DType.I32),
    lambda: AllReduce(Mem(1, 0), U64_MAX + 1, DType.U8),
    lambda: ReduceScatter(Mem(1, 0), Mem(1, 0), 4, DType.F64),
    lambda: AllGather(None, Mem(1, 0), 4),
    lambda: Broadcast(Mem(1, 0), 0, 0, command=True),
    lambda: Send(Mem(1, 0), 1, MAX_RANKS),
    lambda: Recv(Mem(1, 0), 1, 0, stream=U64_MAX + 1),
    lambda: Submit(1, ()),
    lambda: Submit(1, (Hello(1, 1, 1, "w", 0, 1, 1),)),  # type: ignore[arg-type]
    lambda: Submit(1, (Mem(1, 0),)),  # type: ignore[arg-type]
    lambda: Forget(()),
    lambda: Welcome(1, U64_MAX + 1, "v", "e", 0, 1),
    lambda: Ok(0),
    lambda: Ok(1, nfds=-1),
    lambda: Error(U64_MAX + 1, ErrorCode.INTERNAL, ""),
    lambda: Event(EventKind.SHUTDOWN, "", ""),
    lambda: Event("", ErrorCode.SHUTDOWN, ""),
    lambda: Event(EventKind.SHUTDOWN, "c" * (proto.MAX_ERROR_CODE + 1), ""),
    lambda: Import(1, 1, MemKind.HOST, 0),
    lambda: Hello(1, 1, 1, "w", 1, 1, 1),
    lambda: StatusReport(0, {}),
    # integers are ints: a float or a numpy integer passes a range check, then fails to
    # pack or reaches the daemon as a float
    lambda: AllReduce(Mem(1, 0), 8.0, DType.U8),  # type: ignore[arg-type]
    lambda: AllReduce(Mem(1, 0), np.int64(8), DType.U8),  # type: ignore[arg-type]
    lambda: Mem(True, 0),
    lambda: Broadcast(Mem(1, 0), 4, 1.0),  # type: ignore[arg-type]
    lambda: Hello(1, 1, 1, "w", 0, 1, 1, epoch=1 << 62),  # no room for the epochs after it
])
def test_constructors_validate(build: Callable[[], object]) -> None:
    raises_exactly(InvalidMessage, build)


@pytest.mark.parametrize("thing", [Mem(1, 0), Barrier(), AllReduce(None, 0), "ok", {"t": "ok"}, None])
def test_encode_refuses_what_is_not_a_message(thing: Any) -> None:
    assert "is not a message" in str(raises_exactly(InvalidMessage, lambda: encode(thing)))


@pytest.mark.parametrize("info", [{"s": {1, 2}}, {"big": U64_MAX + 1}, {"o": object()}, {"x": "\ud800"}])
def test_encode_refuses_unencodable_content(info: dict[str, Any]) -> None:
    raises_exactly(InvalidMessage, lambda: encode(StatusReport(1, info)))


def test_messages_are_frozen() -> None:
    msg = Ok(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.id = 2  # type: ignore[misc]


# ---- garbage never escapes as anything but ProtoError -----------------------------------

def check_decode_total(data: bytes, nfds: int) -> None:
    try:
        msg = decode(data, nfds)
    except ProtoError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event(f"decoded: {type(msg).__name__}")
    assert type(msg) in MESSAGE_TYPES
    assert expected_fds(msg) == nfds
    again = decode(encode(msg), nfds)  # what decodes also encodes, with the same meaning
    assert type(again) is type(msg)
    if not isinstance(msg, StatusReport):  # info may hold NaN, which is unequal to itself
        assert again == msg


GARBAGE = settings(max_examples=2000, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


@GARBAGE
@given(data=st.binary(max_size=512), nfds=st.integers(0, 2))
def test_random_bytes_only_raise_proto_errors(data: bytes, nfds: int) -> None:
    check_decode_total(data, nfds)


odd_values = st.one_of(
    json_like,
    st.sampled_from([0, -1, 1, U64_MAX, -(1 << 63), True, False, None, "", b"", [], [1, 0], [0, 0],
                     [1, 2, 3], {}, 1.0, "bf16", "host", "shutdown", "misuse"]),
    st.sampled_from(sorted(set(TAGS.values()))),
)


def _reshape(draw: st.DrawFn, raw: dict[str, Any]) -> None:
    """Give one field (of the message or of its first op) another value, or drop or add one."""
    if raw.get("ops") and draw(st.booleans()):
        raw = raw["ops"][0]
    key = draw(st.sampled_from([*sorted(raw), "zz"]))
    if draw(st.integers(0, 4)) == 0:
        raw.pop(key, None)
    else:
        raw[key] = draw(odd_values)


@st.composite
def mutated(draw: st.DrawFn, damage: bool = True) -> tuple[bytes, int]:
    """A valid packet, reshaped at the msgpack level and/or (if `damage`) damaged byte by byte."""
    msg = draw(messages)
    raw = unpack(encode(msg))
    reshape = not damage or draw(st.booleans())
    if reshape:
        _reshape(draw, raw)
    data = bytearray(pack(raw))
    for _ in range(draw(st.integers(0 if reshape else 1, 3)) if damage else 0):
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
            data[at:at] = encode(draw(messages))[: draw(st.integers(1, 32))]
    nfds = draw(st.sampled_from([expected_fds(msg), 0, 1]))
    return bytes(data), nfds


@GARBAGE
@given(case=mutated())
def test_mutated_packets_only_raise_proto_errors(case: tuple[bytes, int]) -> None:
    check_decode_total(*case)


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated(damage=False))
def test_reshaped_packets_only_raise_proto_errors(case: tuple[bytes, int]) -> None:
    check_decode_total(*case)


@settings(max_examples=300, deadline=None, database=None)
@given(raw=st.dictionaries(
    st.sampled_from(["t", "id", "ops", "buf", "nbytes", "kind", "world", "rank", "info", "bufs", "zz"]),
    st.one_of(st.sampled_from(sorted(set(TAGS.values()))), json_like), max_size=6))
def test_random_maps_only_raise_proto_errors(raw: dict[str, Any]) -> None:
    check_decode_total(pack(raw), 0)


def test_a_hellos_gpu_uuid_is_optional_sixteen_bytes_and_needs_a_device() -> None:
    old_client = msgpack.packb({"t": "hello", "id": 1, "version": 1, "pid": 9, "world": "w", "rank": 0,
                                "world_size": 1, "timeout_ms": 5, "device": 3})
    assert decode(old_client) == Hello(1, 1, 9, "w", 0, 1, 5, device=3)  # no device_uuid: none
    uuid = bytes(range(16))
    assert decode(encode(Hello(1, 1, 9, "w", 0, 1, 5, device=0, device_uuid=uuid))).device_uuid == uuid
    with pytest.raises(InvalidMessage, match="16 bytes"):
        Hello(1, 1, 9, "w", 0, 1, 5, device=0, device_uuid=b"\x01" * 5)
    with pytest.raises(InvalidMessage, match="give both"):
        Hello(1, 1, 9, "w", 0, 1, 5, device_uuid=uuid)
