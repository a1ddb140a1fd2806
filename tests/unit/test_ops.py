"""commd/ops.py's checks of one rank's call, before it is matched."""

from __future__ import annotations

import pytest

import proto
from commd import ops
from commd.errors import CallError

pytestmark = pytest.mark.timeout(10)


def gather(send: tuple[int, int], recv: tuple[int, int], nbytes: int = 100) -> proto.AllGather:
    return proto.AllGather(proto.Mem(*send), proto.Mem(*recv), nbytes)


def scatter(send: tuple[int, int], recv: tuple[int, int], nbytes: int = 100) -> proto.ReduceScatter:
    return proto.ReduceScatter(proto.Mem(*send), proto.Mem(*recv), nbytes)


# rank 2 of 4, 100-byte blocks: in place is the rank's block at offset 200 of the 400-byte whole
@pytest.mark.parametrize("op", [
    gather((1, 200), (1, 0)),  # in place
    gather((1, 0), (1, 100)),  # touching, not overlapping
    gather((1, 500), (1, 100)),
    gather((1, 0), (2, 0)),  # other buffers
    scatter((1, 0), (1, 200)),  # in place
    scatter((1, 400), (1, 300)),  # touching
    scatter((1, 0), (2, 0)),
])
def test_calls_whose_memory_does_not_overlap_or_overlaps_in_place_pass(op: proto.Op) -> None:
    ops.check_overlap(op, 2, 4)


@pytest.mark.parametrize("op", [
    gather((1, 201), (1, 0)),
    gather((1, 0), (1, 0)),  # rank 0's place, not rank 2's
    gather((1, 3), (1, 0), 1),  # (1-byte blocks: rank 2's is at 2)
    scatter((1, 0), (1, 199)),
    scatter((1, 100), (1, 200)),
])
def test_calls_whose_memory_overlaps_otherwise_are_misuse(op: proto.Op) -> None:
    with pytest.raises(CallError, match="overlap") as caught:
        ops.check_overlap(op, 2, 4)
    assert caught.value.code is proto.ErrorCode.MISUSE


def send(at: tuple[int, int], nbytes: int = 100) -> proto.Send:
    return proto.Send(proto.Mem(*at), nbytes, 1)


def recv(at: tuple[int, int], nbytes: int = 100) -> proto.Recv:
    return proto.Recv(proto.Mem(*at), nbytes, 1)


def broadcast(at: tuple[int, int], root: int) -> proto.Broadcast:
    return proto.Broadcast(proto.Mem(*at), 100, root)


def reduce(at: tuple[int, int]) -> proto.AllReduce:
    return proto.AllReduce(proto.Mem(*at), 100, proto.DType.U8)


# rank 2 of 4, groups whose calls only read what another uses, or are all collectives
@pytest.mark.parametrize("group", [
    (send((1, 0)), send((1, 50))),  # two sends read alike
    (send((1, 0)), recv((1, 100))),  # touching, not overlapping
    (recv((1, 0)), recv((2, 0))),  # other buffers
    (broadcast((1, 0), 2), send((1, 0))),  # the root's broadcast reads its buffer
    (gather((1, 0), (2, 0)), send((1, 0))),  # an all_gather reads its send memory
    (reduce((1, 0)), gather((1, 0), (1, 100)), scatter((1, 0), (1, 500))),  # collectives, in order
    (proto.Barrier(), recv((1, 0))),
])
def test_groups_whose_transfers_write_nothing_another_call_uses_pass(group: tuple[proto.Op, ...]) -> None:
    ops.check_group_overlap(group, 2, 4)


@pytest.mark.parametrize("group,writer,user", [
    ((send((1, 0)), recv((1, 99))), 1, 0),
    ((recv((1, 50)), recv((1, 0))), 0, 1),  # (two receives: the one that starts later first)
    ((reduce((1, 0)), send((1, 99))), 0, 1),
    ((recv((1, 10)), reduce((1, 0))), 0, 1),
    ((broadcast((1, 0), 0), send((1, 0))), 0, 1),  # a non-root's broadcast writes its buffer
    ((gather((2, 0), (1, 0)), send((1, 399))), 0, 1),  # an all_gather writes world_size blocks
    ((scatter((1, 0), (2, 0)), recv((1, 399))), 1, 0),  # a reduce_scatter reads world_size blocks
])
def test_groups_whose_transfers_meet_memory_another_call_writes_are_misuse(
        group: tuple[proto.Op, ...], writer: int, user: int) -> None:
    with pytest.raises(CallError, match=f"call #{writer} of the group, .*, (receives into|writes) memory "
                                        f"that call #{user}, .*, uses: they run together") as caught:
        ops.check_group_overlap(group, 2, 4)
    assert caught.value.code is proto.ErrorCode.MISUSE
