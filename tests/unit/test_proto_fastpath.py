"""The codec's steady-state shortcuts give exactly what the generic path gives."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proto
from proto import codec

pytestmark = pytest.mark.timeout(30)


@settings(deadline=None)  # (a stalled machine is no failure)
@given(st.integers(1, 2**64 - 1))
def test_plain_ok_encodes_like_the_generic_path(request_id: int) -> None:
    generic = msgpack.packb(codec._to_wire(proto.Ok(request_id)), use_bin_type=True)
    assert proto.encode(proto.Ok(request_id)) == generic
    assert proto.decode(generic) == proto.Ok(request_id)


@settings(max_examples=200)
@given(st.integers(1, 2**64 - 1), st.integers(0, 1 << 20), st.sampled_from(list(proto.DType)),
       st.integers(0, 2**64 - 1))
def test_cached_submit_decodes_like_the_generic_path(request_id: int, elems: int,
                                                     dtype: proto.DType, epoch: int) -> None:
    cache: codec.OpsCache = {}
    op = proto.AllReduce(proto.Mem(3, 8) if elems else None, elems * dtype.itemsize, dtype)
    first = proto.encode(proto.Submit(1, (op,), epoch))
    assert proto.decode(first, ops_cache=cache) == proto.Submit(1, (op,), epoch)  # fills the cache
    again = proto.encode(proto.Submit(request_id, (op,), epoch))
    assert proto.decode(again, ops_cache=cache) == proto.decode(again) \
        == proto.Submit(request_id, (op,), epoch)


def test_the_cache_never_answers_for_another_epoch() -> None:
    cache: codec.OpsCache = {}
    ops = (proto.AllReduce(proto.Mem(1, 0), 8),)
    for epoch in (3, 4, 3, 0):
        msg = proto.Submit(5, ops, epoch)
        packet = proto.encode(msg, packed_ops={})
        assert proto.decode(packet, ops_cache=cache) == msg
    assert len(cache) == 3


def test_the_cache_never_answers_for_other_bytes() -> None:
    cache: codec.OpsCache = {}
    a = proto.Submit(7, (proto.AllReduce(proto.Mem(1, 0), 8),))
    b = proto.Submit(7, (proto.AllReduce(proto.Mem(1, 0), 16),))
    assert proto.decode(proto.encode(a), ops_cache=cache) == a
    assert proto.decode(proto.encode(b), ops_cache=cache) == b
    # the same ops under a non-canonical key order take the generic path and still decode
    raw = {"ops": codec._to_wire(a)["ops"], "id": 9, "t": "submit"}
    assert proto.decode(msgpack.packb(raw), ops_cache=cache) == proto.Submit(9, a.ops)
    # a cached suffix behind a bad id is still refused
    bad = {"t": "submit", "id": "x", "ops": codec._to_wire(a)["ops"]}
    with pytest.raises(proto.ProtoError):
        proto.decode(msgpack.packb(bad), ops_cache=cache)
    with pytest.raises(proto.ProtoError):
        proto.decode(proto.encode(proto.Submit(1, a.ops)).replace(b"\xa2id\x01", b"\xa2id\x00"),
                     ops_cache=cache)


@pytest.mark.parametrize("fourth", [b"\xa2id\x05", b"\xa1t\xa6submit", b"\xa3ops\x90"])
def test_a_repeated_key_in_place_of_the_epoch_decodes_like_the_generic_path(fourth: bytes) -> None:
    """A map whose fourth entry repeats a key (the last value wins) has no epoch: the
    generic path takes the default, and so must the cache, the second time (before: KeyError)."""
    canonical = proto.encode(proto.Submit(5, (proto.AllReduce(proto.Mem(1, 0), 8),)))
    packet = canonical[:canonical.index(codec._EPOCH_KEY)] + fourth
    cache: codec.OpsCache = {}
    try:
        generic: object = proto.decode(packet)
    except proto.ProtoError as exc:
        generic = type(exc)
    for _ in range(2):
        try:
            cached: object = proto.decode(packet, ops_cache=cache)
        except proto.ProtoError as exc:
            cached = type(exc)
        assert cached == generic


@pytest.mark.parametrize("form", [b"\xcc\x05", b"\xcd\x00\x05", b"\xce\x00\x00\x00\x05",
                                  b"\xcf" + bytes(7) + b"\x05", b"\xcd\x01\x00", b"\xcf\xff"])
def test_a_cached_suffix_behind_any_id_form_decodes_like_the_generic_path(form: bytes) -> None:
    """The cache reads the id itself: one in a longer form than msgpack's shortest (valid),
    or cut short, must come out as the generic path has it."""
    canonical = proto.encode(proto.Submit(9, (proto.AllReduce(proto.Mem(1, 0), 8),), 2))
    packet = canonical.replace(codec._SUBMIT_HEAD + b"\x09", codec._SUBMIT_HEAD + form, 1)
    cache: codec.OpsCache = {}
    assert proto.decode(canonical, ops_cache=cache).id == 9  # type: ignore[union-attr]
    try:
        generic: object = proto.decode(packet)
    except proto.ProtoError as exc:
        generic = type(exc)
    try:
        cached: object = proto.decode(packet, ops_cache=cache)
    except proto.ProtoError as exc:
        cached = type(exc)
    assert cached == generic


def test_a_repeated_id_behind_the_ops_is_never_answered_from_the_cache() -> None:
    """{t, id: 7, ops, id: 5} is call 5 (the last value wins), however often it comes, and
    the same ops with a canonical epoch after it stay call 7."""
    canonical = proto.encode(proto.Submit(7, (proto.AllReduce(proto.Mem(1, 0), 8),)))
    repeated = canonical[:canonical.index(codec._EPOCH_KEY)] + b"\xa2id\x05"
    cache: codec.OpsCache = {}
    for _ in range(2):
        assert proto.decode(repeated, ops_cache=cache).id == 5  # type: ignore[union-attr]
        assert proto.decode(canonical, ops_cache=cache).id == 7  # type: ignore[union-attr]


def test_the_cache_is_bounded() -> None:
    cache: codec.OpsCache = {}
    for n in range(codec.OPS_CACHE_SIZE + 10):
        msg = proto.Submit(1, (proto.AllReduce(proto.Mem(1, 0), 2 * (n + 1)),))
        assert proto.decode(proto.encode(msg), ops_cache=cache) == msg
    assert len(cache) <= codec.OPS_CACHE_SIZE


def test_the_cache_is_bounded_in_bytes() -> None:
    """Large groups fill the bytes before the count (a client's distinct 512-op groups
    held ~37 MiB of the daemon's memory per connection)."""
    cache: codec.OpsCache = {}
    for n in range(64):
        msg = proto.Submit(1, tuple(proto.AllReduce(proto.Mem(1 + n, i), 2) for i in range(512)))
        assert proto.decode(proto.encode(msg), ops_cache=cache) == msg
        assert sum(map(len, cache)) <= codec.OPS_CACHE_BYTES
    assert cache  # (still caching)


@settings(max_examples=100)
@given(st.lists(st.sampled_from([
    proto.AllReduce(proto.Mem(1, 0), 8), proto.Barrier(), proto.Send(proto.Mem(2, 4), 4, 1, 99),
    proto.Broadcast(None, 0, 3), proto.ReduceScatter(proto.Mem(5, 0), proto.Mem(6, 0), 16)]),
    min_size=1, max_size=20), st.integers(1, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_packed_ops_encode_like_the_generic_path(ops: list[proto.Op], request_id: int,
                                                 epoch: int) -> None:
    packed: codec.PackedOps = {}
    msg = proto.Submit(request_id, tuple(ops), epoch)
    generic = msgpack.packb(codec._to_wire(msg), use_bin_type=True)
    assert proto.encode(msg, packed_ops=packed) == generic
    assert proto.encode(msg, packed_ops=packed) == generic  # from the cache this time


def test_plain_ok_shortcut_refuses_what_the_generic_path_refuses() -> None:
    head, tail = codec._OK_HEAD, codec._OK_TAIL
    for middle in (b"\x00", b"\xd0\xff", b"\xa1x", b"\x01\x02"):  # id 0, id -1, a str, two values
        with pytest.raises(proto.ProtoError):
            proto.decode(head + middle + tail)
    assert proto.decode(head + b"\x05" + tail) == proto.Ok(5)
    assert proto.decode(head + b"\xcf" + b"\xff" * 8 + tail) == proto.Ok(2**64 - 1)
    with pytest.raises(proto.ProtoError):
        proto.decode(head + b"\x05" + tail, nfds=1)  # a plain Ok carries no fd


def _outcome(data: bytes, cache: codec.OpsCache | None, nfds: int = 0) -> object:
    try:
        return proto.decode(data, nfds, ops_cache=cache)
    except proto.ProtoError as exc:
        return type(exc), str(exc)


_PRIMED = [
    proto.Submit(9, (proto.AllReduce(proto.Mem(1, 0), 8),), 2),
    proto.Submit(200, (proto.AllReduce(None, 0),)),
    proto.Submit(70000, (proto.Send(proto.Mem(2, 4), 4, 1, 99), proto.Recv(proto.Mem(3, 0), 4, 0, 99)), 7),
    proto.Submit(2**40, (proto.AllGather(proto.Mem(5, 0), proto.Mem(6, 0), 16), proto.Barrier()), 2**63),
    proto.Submit(1, (proto.Broadcast(proto.Mem(4, 8), 0, 3),)),
]


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(_PRIMED), st.integers(0, 4), st.integers(0, 2**16), st.binary(max_size=9),
       st.integers(0, 3), st.integers(0, 2))
def test_a_mutated_packet_decodes_from_a_primed_cache_as_the_generic_path_has_it(
        msg: proto.Submit, how: int, at: int, bytes_: bytes, cut: int, nfds: int) -> None:
    """A hostile worker's packet, after its connection's cache is primed with the packets it
    repeats: whatever it changes (a byte, an inserted or deleted run, the id's form, the
    end), the cache answers exactly what decoding the packet afresh gives."""
    cache: codec.OpsCache = {}
    for primer in _PRIMED:
        assert proto.decode(proto.encode(primer), ops_cache=cache) == primer
    packet = proto.encode(msg)
    at %= len(packet) + 1
    if how == 0:  # bytes overwritten
        packet = packet[:at] + bytes_ + packet[at + len(bytes_):]
    elif how == 1:  # bytes inserted
        packet = packet[:at] + bytes_ + packet[at:]
    elif how == 2:  # a run deleted
        packet = packet[:at] + packet[at + len(bytes_) + 1:]
    elif how == 3:  # the id written in another form, or replaced by other bytes
        ends = codec._ID_AT + len(msgpack.packb(msg.id))
        packet = codec._SUBMIT_HEAD + bytes_ + packet[ends:]
    packet = packet[:len(packet) - cut] if how == 4 else packet
    generic = _outcome(packet, None, nfds)
    assert _outcome(packet, cache, nfds) == generic
    assert _outcome(packet, cache, nfds) == generic  # (the first may have filled the cache)
