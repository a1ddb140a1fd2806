"""Every CommBackend call through a real daemon and real worker processes, checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import proto
from client import DaemonBackend, MisuseError, hostmem
from tests.fault.ranks import on_both
from tests.integration import workers
from tests.integration.data import FLOATS, NUMPY, make_input, reduce_reference, signed_zeros_reference
from tests.integration.harness import RankPool, world_name

pytestmark = pytest.mark.timeout(120)

RANKS = [1, 2, 3, 4]
# (elements) 0 B, one bf16 element (2 B), an odd count, 1 MiB of bf16
ELEMS = [0, 1, 1001, 512 * 1024]


def run(pool: RankPool, sock: str, n: int, fn: object, *args: object) -> list[object]:
    world = world_name()
    outcomes = pool.run(fn, [(sock, world, rank, n, *args) for rank in range(n)])  # type: ignore[arg-type]
    return [o.unwrap() for o in outcomes]


def as_array(raw: object, dtype: str) -> np.ndarray:
    assert isinstance(raw, bytes)
    return np.frombuffer(raw, NUMPY[dtype])


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("nelem", ELEMS)
def test_all_reduce_default_is_bf16_sum(pool: RankPool, sock: str, n: int, nelem: int) -> None:
    results = run(pool, sock, n, workers.all_reduce, nelem, None, None, 11)
    want = reduce_reference([make_input(11, r, nelem, "bf16", "sum") for r in range(n)], "bf16", "sum")
    for raw in results:
        got = as_array(raw, "bf16")
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32", "f64", "i32", "i64", "u8"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_all_reduce_dtypes_and_ops(pool: RankPool, sock: str, dtype: str, op: str) -> None:
    n, nelem = 3, 777
    results = run(pool, sock, n, workers.all_reduce, nelem, dtype, op, 5, 24)  # offset pointer
    want = reduce_reference([make_input(5, r, nelem, dtype, op) for r in range(n)], dtype, op)
    for raw in results:
        assert as_array(raw, dtype).tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("n,nelem", [(2, 4), (3, 8), (4, 16), (3, 70001)])  # 70001: chunked, on threads
def test_min_and_max_order_signed_zeros_whatever_rank_holds_them(pool: RankPool, sock: str, dtype: str,
                                                                op: str, n: int, nelem: int) -> None:
    """-0.0 < +0.0 (IEEE 754-2019 minimumNumber/maximumNumber; CUDA's __hmin/__hmax): before,
    numpy's fmin/fmax gave back whichever zero came second, so max(+0.0 on rank 0, -0.0 on
    rank 1) was -0.0 and the same zeros the other way round +0.0: the result depended on
    which rank held which."""
    full = signed_zeros_reference(n, nelem * n, dtype, op)
    for rank, (reduced, scattered) in enumerate(run(pool, sock, n, workers.signed_zero_reductions,
                                                    nelem, dtype, op)):
        assert reduced == full[:nelem].tobytes(), np.frombuffer(reduced, NUMPY[dtype])[:2 ** n]
        assert scattered == full[rank * nelem:(rank + 1) * nelem].tobytes()


def test_all_reduce_large_runs_on_threads(pool: RankPool, sock: str) -> None:
    n, nelem = 4, 3 * 1024 * 1024 + 5  # 6 MiB bf16: over the inline limit, uneven split
    results = run(pool, sock, n, workers.all_reduce, nelem, "bf16", "sum", 3)
    want = reduce_reference([make_input(3, r, nelem, "bf16", "sum") for r in range(n)], "bf16", "sum")
    for raw in results:
        assert raw == want.tobytes()


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("nelem", ELEMS)
def test_all_reduce_async_completes_in_place(pool: RankPool, sock: str, n: int, nelem: int) -> None:
    results = run(pool, sock, n, workers.all_reduce, nelem, None, None, 8, 0, True)
    want = reduce_reference([make_input(8, r, nelem, "bf16", "sum") for r in range(n)], "bf16", "sum")
    assert all(raw == want.tobytes() for raw in results)


def test_all_reduce_async_f32(pool: RankPool, sock: str) -> None:
    results = run(pool, sock, 2, workers.all_reduce, 4099, "f32", "sum", 8, 0, True)
    want = reduce_reference([make_input(8, r, 4099, "f32", "sum") for r in range(2)], "f32", "sum")
    assert all(raw == want.tobytes() for raw in results)


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("nbytes", [0, 2, 1001, 1 << 20])
def test_all_gather_in_rank_order(pool: RankPool, sock: str, n: int, nbytes: int) -> None:
    results = run(pool, sock, n, workers.all_gather, nbytes, 21)
    want = b"".join(make_input(21, r, nbytes, "u8", "sum").tobytes() for r in range(n))
    assert all(raw == want for raw in results)


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("share", [0, 2, 1001, 1 << 20])
def test_reduce_scatter_default_is_u8_sum(pool: RankPool, sock: str, n: int, share: int) -> None:
    results = run(pool, sock, n, workers.reduce_scatter, share, None, None, 31)
    full = reduce_reference([make_input(31, r, share * n, "u8", "sum") for r in range(n)], "u8", "sum")
    for rank, raw in enumerate(results):
        assert raw == full[rank * share:(rank + 1) * share].tobytes()


@pytest.mark.parametrize("n", [2, 3])
def test_all_gather_and_reduce_scatter_in_place_and_refused_overlaps(pool: RankPool, sock: str,
                                                                    n: int) -> None:
    """Send and receive memory overlapping other than in place gave wrong data, no error:
    the op read what it had already written."""
    nbytes = 1000
    inputs = [make_input(51, r, nbytes * n, "u8", "sum") for r in range(n)]
    full = reduce_reference(inputs, "u8", "sum").tobytes()
    for rank, result in enumerate(run(pool, sock, n, workers.in_place_and_overlapping, nbytes, 51)):
        assert isinstance(result, tuple)
        gathered, reduced, errors = result
        assert gathered == b"".join(inputs[r][r * nbytes:(r + 1) * nbytes].tobytes() for r in range(n))
        assert reduced == full[rank * nbytes:(rank + 1) * nbytes]
        assert errors == [f"MisuseError: {name}: send and receive memory overlap; in place, rank {rank}'s "
                          f"block starts {rank * size} bytes into the {n * size}-byte buffer"
                          for name, size in (("all_gather", nbytes), ("reduce_scatter", nbytes - 1))]


def test_a_group_receiving_into_memory_it_sends_from_is_refused(pool: RankPool, sock: str) -> None:
    """Pipeline stages swapping activations in place: a group's calls run together, so a
    receive into memory a send of the group reads may land first (before: no error, and the
    peer got some of its own bytes back in about half the rounds). Refused as an overlap of
    one call is (MisuseError: the group did not happen), the ranks go on."""
    nbytes = 1 << 20
    for rank, (error, got) in enumerate(run(pool, sock, 2, workers.swap_in_one_buffer, nbytes)):
        assert error == (f"MisuseError: group_end: call #1 of the group, recv_from(bytes={nbytes}, "
                         f"peer={1 - rank}), receives into memory that call #0, send_to(bytes={nbytes}, "
                         f"peer={1 - rank}), uses: they run together")
        assert got == bytes([2 - rank]) * nbytes


def test_a_group_passing_on_memory_its_collective_writes_is_refused(pool: RankPool, sock: str) -> None:
    """A group's transfer runs when its peer's call comes, its collective when the last
    rank's does, in no fixed order: rank 1 sending rank 0 the buffer both all_reduce, rank 0
    receiving into it (before: no error, and what every rank held after the same calls hung on
    which rank called last: rank 1 last, [7, ...] on rank 0 and the sum, 111, on the others;
    rank 2 last, 117, the sum of what rank 0 had received, everywhere). Refused as a transfer's overlap with
    another is (MisuseError: the group did not happen), the ranks go on."""
    results = run(pool, sock, 3, workers.reduce_and_pass_in_one_group)
    reduce, send, recv = ("all_reduce(bytes=16, dtype=i32, op=sum)", "send_to(bytes=16, peer=0)",
                          "recv_from(bytes=16, peer=1)")
    assert [error for error, _, _ in results] == [
        f"MisuseError: group_end: call #1 of the group, {recv}, receives into memory that call #0, "
        f"{reduce}, uses: they run together",
        f"MisuseError: group_end: call #0 of the group, {reduce}, writes memory that call #1, "
        f"{send}, uses: they run together",
        "no error"]
    assert [summed for _, summed, _ in results] == [[111] * 4] * 3
    assert results[0][2] == [7] * 4


@pytest.mark.parametrize("dtype,op", [("bf16", "sum"), ("f32", "max"), ("i64", "prod"), ("f16", "min")])
def test_reduce_scatter_dtypes(pool: RankPool, sock: str, dtype: str, op: str) -> None:
    n, share = 4, 333
    results = run(pool, sock, n, workers.reduce_scatter, share, dtype, op, 41)
    full = reduce_reference([make_input(41, r, share * n, dtype, op) for r in range(n)], dtype, op)
    for rank, raw in enumerate(results):
        assert raw == full[rank * share:(rank + 1) * share].tobytes()


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("nbytes", [0, 2, 1001, 1 << 20])
def test_broadcast_from_every_root(pool: RankPool, sock: str, n: int, nbytes: int) -> None:
    for root in range(n):
        results = run(pool, sock, n, workers.broadcast, nbytes, root, 51)
        want = make_input(51, root, nbytes, "u8", "sum").tobytes()
        assert all(raw == want for raw in results), f"root {root}"


@pytest.mark.parametrize("n", RANKS)
def test_barrier_waits_for_the_last_rank(pool: RankPool, sock: str, n: int) -> None:
    times = run(pool, sock, n, workers.barrier, 0.15)
    last_arrival = max(arrived for arrived, _ in times)  # type: ignore[misc]
    for _arrived, left in times:  # type: ignore[misc]
        assert left >= last_arrival - 0.005, "a rank left the barrier before the last one arrived"


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("nbytes", [0, 2, 1001, 1 << 20])
def test_send_recv_every_pair_in_a_group(pool: RankPool, sock: str, n: int, nbytes: int) -> None:
    results = run(pool, sock, n, workers.send_recv_pairs, nbytes, 61)
    for rank, received in enumerate(results):
        assert isinstance(received, dict)
        for peer, raw in received.items():
            assert raw == make_input(61 + 1000 * peer + rank, 0, nbytes, "u8", "sum").tobytes()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("nbytes", [0, 4097])
def test_send_recv_ungrouped(pool: RankPool, sock: str, n: int, nbytes: int) -> None:
    results = run(pool, sock, n, workers.send_then_recv, nbytes, 71)
    assert results[0] == make_input(71, n - 1, nbytes, "u8", "sum").tobytes()
    assert results[n - 1] == make_input(71, 0, nbytes, "u8", "sum").tobytes()


@pytest.mark.parametrize("n", [2, 4])
def test_recv_command_u32(pool: RankPool, sock: str, n: int) -> None:
    commands = [7, 0, 0xFFFFFFFF, 123456, 42, 1]
    results = run(pool, sock, n, workers.command_loop, commands)
    assert all(got == commands for got in results)


def test_recv_command_refuses_root(pool: RankPool, sock: str) -> None:
    assert run(pool, sock, 2, workers.root_recv_command) == ["MisuseError", "MisuseError"]


@pytest.mark.parametrize("n,grouping", [(1, None), (3, None), (3, (0,)), (3, (0, 2))])
def test_group_submits_calls_together(pool: RankPool, sock: str, n: int,
                                      grouping: tuple[int, ...] | None) -> None:
    """A group's calls match the other ranks' calls one by one, as separate calls do
    (WIRE.md `submit`): a rank may group calls that the others make one at a time."""
    results = run(pool, sock, n, workers.group_two_reduces, 513, 81, grouping)
    want_a = reduce_reference([make_input(81, r, 513, "f32", "sum") for r in range(n)], "f32", "sum")
    want_b = reduce_reference([make_input(82, r, 513, "i32", "max") for r in range(n)], "i32", "max")
    assert all(res == (want_a.tobytes(), want_b.tobytes()) for res in results)


def test_groups_nest_and_a_full_group_refuses_the_next_call_and_stays_open(sock: str) -> None:
    """NCCL's groups nest (the outermost ncclGroupEnd submits) and the wire holds 512 calls
    a group: rank 0 opens a group inside a group and makes 513 calls, the last refused
    (MisuseError) with the group still open; the inner group_end sends nothing, the outer
    sends the 512, which pair with rank 1's 512 one at a time. The refused call took no
    place in the order: the next all_reduce of both ranks pairs with each other."""
    calls, world = proto.MAX_GROUP_OPS, world_name()
    comms = on_both(lambda r: DaemonBackend(sock, world, r, 2, timeout=20))
    try:
        bufs = [hostmem.alloc(4 * (calls + 1)) for _ in range(2)]
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:] = np.arange(calls + 1) + 1000 * r

        def rank(r: int) -> tuple[str, list[int]]:
            comm, base = comms[r], bufs[r].ptr
            refused, inner_end = "", []
            if r == 0:
                comm.group_start()
                comm.group_start()
                for i in range(calls):
                    comm.all_reduce(base + 4 * i, 4, dtype="i32")
                with pytest.raises(MisuseError) as raised:
                    comm.all_reduce(base + 4 * calls, 4, dtype="i32")
                refused = str(raised.value)
                comm.group_end()
                inner_end = bufs[0].view(np.int32)[:calls].tolist()
                comm.group_end()
            else:
                for i in range(calls):
                    comm.all_reduce(base + 4 * i, 4, dtype="i32")
            comm.all_reduce(base + 4 * calls, 4, dtype="i32")
            return refused, inner_end

        (refused, inner_end), _ = on_both(rank)
        assert refused == f"a group holds at most {calls} calls"
        assert inner_end == list(range(calls))  # (nothing sent at the inner group_end)
        summed = (2 * np.arange(calls + 1) + 1000).tolist()
        assert [buf.view(np.int32).tolist() for buf in bufs] == [summed, summed]
        assert all(comm.is_healthy() for comm in comms)
    finally:
        for comm in comms:
            comm.close()

@pytest.mark.parametrize("n", RANKS)
def test_rank_world_size_health(pool: RankPool, sock: str, n: int) -> None:
    results = run(pool, sock, n, workers.identity)
    assert results == [(r, n, True, 1) for r in range(n)]


def test_register_deregister_and_add_kernel(pool: RankPool, sock: str) -> None:
    results = run(pool, sock, 2, workers.register_and_kernel, 0xABCDEF)
    for res in results:
        assert isinstance(res, dict)
        h1, h2 = res["handles"]
        assert h1 != h2 and h1 > 0 and h2 > 0
        assert res["kernels"] == {"0": 0xABCDEF, "1": 0xABCDEF}
        assert res["errors"] == ["MisuseError", "MisuseError"]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_symmetric_alloc_pointer_is_valid_in_the_worker(pool: RankPool, sock: str, n: int) -> None:
    results = run(pool, sock, n, workers.symmetric, 1000, 91)
    want = reduce_reference([make_input(91, r, 1000, "f32", "sum") for r in range(n)], "f32", "sum")
    for res in results:
        assert isinstance(res, dict)
        assert res["result"] == want.tobytes()
        assert res["errors"] == ["MisuseError", "MisuseError"]


@pytest.mark.parametrize("n", [1, 3])
def test_attempt_reconnect_rebuilds_at_next_epoch(pool: RankPool, sock: str, n: int) -> None:
    results = run(pool, sock, n, workers.reconnect_all, 101)
    want = reduce_reference([make_input(101, r, 64, "f32", "sum") for r in range(n)], "f32", "sum")
    assert all(res == (1, 2, want.tobytes()) for res in results)
