"""Call k across ranks: matching order, p2p pairing, and mismatch messages."""

from __future__ import annotations

import pytest

import proto
from commd.matching import Call, CollectiveMatch, Matcher, Mismatch, P2PMatch

pytestmark = pytest.mark.timeout(10)
M = proto.Mem(1, 0)


def test_collective_completes_when_every_rank_arrived() -> None:
    m: Matcher[str] = Matcher(3)
    assert m.add(Call(2, proto.AllReduce(M, 8), "c2")) is None
    assert m.add(Call(0, proto.AllReduce(M, 8), "c0")) is None
    match = m.add(Call(1, proto.AllReduce(M, 8), "c1"))
    assert isinstance(match, CollectiveMatch) and match.index == 0
    assert {r: c.token for r, c in match.calls.items()} == {0: "c0", 1: "c1", 2: "c2"}
    assert m.pending() == []


def test_recv_command_matches_the_roots_broadcast() -> None:
    m: Matcher[str] = Matcher(2)
    assert m.add(Call(1, proto.Broadcast(M, 4, 0, command=True), "cmd")) is None
    match = m.add(Call(0, proto.Broadcast(M, 4, 0), "root"))
    assert isinstance(match, CollectiveMatch)


def test_indexes_advance_per_rank() -> None:
    m: Matcher[int] = Matcher(2)
    m.add(Call(0, proto.Barrier(), 0))
    m.add(Call(0, proto.AllReduce(M, 2), 1))  # rank 0 runs ahead by one call
    first = m.add(Call(1, proto.Barrier(), 2))
    second = m.add(Call(1, proto.AllReduce(M, 2), 3))
    assert isinstance(first, CollectiveMatch) and first.index == 0
    assert isinstance(second, CollectiveMatch) and second.index == 1


@pytest.mark.parametrize("a,b,text", [
    (proto.AllReduce(M, 8), proto.AllReduce(M, 16), "bytes=16"),
    (proto.AllReduce(M, 8), proto.AllReduce(M, 8, proto.DType.F32), "dtype=f32"),
    (proto.AllReduce(M, 8), proto.AllReduce(M, 8, op=proto.ReduceOp.MAX), "op=max"),
    (proto.Broadcast(M, 8, 0), proto.Broadcast(M, 8, 1), "root=1"),
    (proto.Barrier(), proto.AllGather(M, M, 4), "all_gather(bytes=4)"),
    (proto.ReduceScatter(M, M, 8), proto.ReduceScatter(M, M, 8, proto.DType.F32), "dtype=f32"),
    (proto.ReduceScatter(M, M, 8), proto.ReduceScatter(M, M, 8, op=proto.ReduceOp.MAX), "op=max"),
])
def test_mismatch_names_both_ranks_and_calls(a: proto.Op, b: proto.Op, text: str) -> None:
    m: Matcher[None] = Matcher(3)
    m.add(Call(0, a, None))
    with pytest.raises(Mismatch) as info:
        m.add(Call(2, b, None))
    message = str(info.value)
    assert "call 0" in message and "rank 0 called" in message and "rank 2 called" in message
    assert text in message and info.value.ranks == (0, 2)


def test_p2p_pairs_by_index_per_direction() -> None:
    m: Matcher[str] = Matcher(2)
    assert m.add(Call(0, proto.Send(M, 8, 1), "s0")) is None
    assert m.add(Call(0, proto.Send(M, 8, 1), "s1")) is None
    assert m.add(Call(1, proto.Send(M, 4, 0), "back")) is None  # the other direction waits alone
    first = m.add(Call(1, proto.Recv(M, 8, 0), "r0"))
    assert isinstance(first, P2PMatch) and (first.send.token, first.recv.token) == ("s0", "r0")
    second = m.add(Call(1, proto.Recv(M, 8, 0), "r1"))
    assert isinstance(second, P2PMatch) and second.index == 1 and second.send.token == "s1"
    assert [c.token for c in m.pending()] == ["back"]


def test_p2p_size_mismatch() -> None:
    m: Matcher[None] = Matcher(2)
    m.add(Call(1, proto.Recv(M, 8, 0), None))
    with pytest.raises(Mismatch, match=r"point-to-point 0->1 call 0: rank 1 called recv_from\(bytes=8"):
        m.add(Call(0, proto.Send(M, 16, 1), None))


def test_send_to_self_pairs_with_recv_from_self() -> None:
    m: Matcher[str] = Matcher(1)
    assert m.add(Call(0, proto.Send(M, 8, 0), "s")) is None
    match = m.add(Call(0, proto.Recv(M, 8, 0), "r"))
    assert isinstance(match, P2PMatch)
