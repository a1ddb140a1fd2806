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
