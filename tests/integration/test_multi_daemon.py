"""Worlds spread over several daemons on this host: every call, checked against numpy.

Placements: 4 ranks over 2 daemons (2+2) and over 3 daemons (1+1+2); the daemon that
hosts rank 0 is the root. Floats follow the documented cross-daemon order
(`grouped_reference`); integers must equal a single daemon's results.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import proto
from commd.engine.hostnet import CHUNK_BYTES, WINDOW_CHUNKS
from commd.launch import DaemonProcess
from commd.status import query_status
from tests.integration import workers
from tests.integration.data import (
    NUMPY,
    grouped_reference,
    make_input,
    reduce_reference,
    signed_zeros_reference,
)
from tests.integration.harness import RankPool, scrape, short_tmpdir, world_name, world_status
from tests.integration.rawclient import RawClient

pytestmark = pytest.mark.timeout(120)

SECRET = {"COMMD_PEER_SECRET": "test-secret-0123456789"}
PLACEMENTS = {"2+2": [0, 0, 1, 1], "1+1+2": [0, 1, 2, 2]}


@pytest.fixture(scope="module")
def daemons() -> Iterator[list[DaemonProcess]]:
    tmp = short_tmpdir()
    procs = []
    try:
        for name in "ABC":
            procs.append(DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", name, "--metrics", "127.0.0.1:0"]).start())
        yield procs
    finally:
        for proc in procs:
            assert proc.stop() == 0
        shutil.rmtree(tmp, ignore_errors=True)


def specs(daemons: list[DaemonProcess], placement: list[int]) -> list[str]:
    """Per rank: its daemon's socket and the root's peer address."""
    root = daemons[placement[0]].peer_address()
    return [f"{daemons[d].socket_path}@{root}" for d in placement]


def groups(placement: list[int]) -> list[list[int]]:
    by_daemon: dict[int, list[int]] = {}
    for rank, daemon in enumerate(placement):
        by_daemon.setdefault(daemon, []).append(rank)
    return list(by_daemon.values())


def run(pool: RankPool, addresses: list[str], fn: object, *args: object) -> list[object]:
    world = world_name("multi")
    outcomes = pool.run(fn, [(addresses[r], world, r, len(addresses), *args)  # type: ignore[arg-type]
                             for r in range(len(addresses))])
    return [o.unwrap() for o in outcomes]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("nelem", [0, 1, 1001, 3 * 1024 * 1024 + 7])
def test_all_reduce_bf16(pool: RankPool, daemons: list[DaemonProcess], placement: str,
                         nelem: int) -> None:
    where = PLACEMENTS[placement]
    results = run(pool, specs(daemons, where), workers.all_reduce, nelem, None, None, 7)
    inputs = [make_input(7, r, nelem, "bf16", "sum") for r in range(4)]
    want = grouped_reference(inputs, "bf16", "sum", groups(where))
    exact = sum(x.astype(np.float64) for x in inputs)
    for raw in results:
        assert raw == want.tobytes()
    # and the grouping changes only the rounding: a member's partial (|x| < 16: half an ulp
    # is 1/32) and the result (|x| < 32: half an ulp is 1/16) are each rounded once
    got = np.frombuffer(results[0], NUMPY["bf16"]).astype(np.float64)  # type: ignore[arg-type]
    assert np.all(np.abs(got - exact) <= 1 / 32 + 1 / 16), np.max(np.abs(got - exact))


@pytest.mark.parametrize("dtype,op", [("i32", "sum"), ("u8", "sum"), ("i64", "prod"), ("f32", "max"),
                                      ("f16", "min"), ("f64", "sum"), ("bf16", "prod")])
def test_all_reduce_dtypes_and_ops(pool: RankPool, daemons: list[DaemonProcess], dtype: str,
                                   op: str) -> None:
    where = PLACEMENTS["1+1+2"]
    results = run(pool, specs(daemons, where), workers.all_reduce, 777, dtype, op, 9, 16)
    inputs = [make_input(9, r, 777, dtype, op) for r in range(4)]
    want = grouped_reference(inputs, dtype, op, groups(where))
    if dtype in ("i32", "u8", "i64") or op in ("max", "min"):
        assert want.tobytes() == reduce_reference(inputs, dtype, op).tobytes()  # order-free
    assert all(raw == want.tobytes() for raw in results)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_order_signed_zeros_across_daemons(pool: RankPool, daemons: list[DaemonProcess],
                                                       dtype: str, op: str) -> None:
    """-0.0 < +0.0 also where the root folds the members' partials in (hostnet): every way
    4 ranks on 3 daemons can hold the two zeros, all_reduce and reduce_scatter."""
    nelem = 16
    full = signed_zeros_reference(4, nelem * 4, dtype, op)
    results = run(pool, specs(daemons, PLACEMENTS["1+1+2"]), workers.signed_zero_reductions, nelem, dtype, op)
    for rank, (reduced, scattered) in enumerate(results):  # type: ignore[misc]
        assert reduced == full[:nelem].tobytes(), np.frombuffer(reduced, NUMPY[dtype])  # type: ignore[call-overload]
        assert scattered == full[rank * nelem:(rank + 1) * nelem].tobytes()


@pytest.mark.parametrize("dtype", ["i32", "u8"])
def test_all_reduce_of_several_chunks_again_and_again(pool: RankPool, daemons: list[DaemonProcess],
                                                      dtype: str) -> None:
    """More than one 4 MiB chunk, in a type that crosses the wire as it is summed: each
    chunk's bytes must be sent before the next chunk is summed into the same buffer."""
    nelem = (9 << 20) // np.dtype(NUMPY[dtype]).itemsize + 7  # type: ignore[call-overload]
    wrong = run(pool, specs(daemons, PLACEMENTS["2+2"]), workers.all_reduce_repeated, nelem, dtype, 6)
    assert wrong == [[]] * 4


# (interleaved: a member's ranks are not side by side in the result, so its stream's chunks
# are cut up between their places)
GATHER_PLACEMENTS = {**PLACEMENTS, "interleaved": [0, 1, 0, 1]}


@pytest.mark.parametrize("placement", GATHER_PLACEMENTS)
@pytest.mark.parametrize("nbytes", [0, 2, 1001, 9 << 20])  # 9 MiB: a member's 2 ranks take credits
def test_all_gather(pool: RankPool, daemons: list[DaemonProcess], placement: str, nbytes: int) -> None:
    results = run(pool, specs(daemons, GATHER_PLACEMENTS[placement]), workers.all_gather, nbytes, 3)
    want = b"".join(make_input(3, r, nbytes, "u8", "sum").tobytes() for r in range(4))
    assert all(raw == want for raw in results)


@pytest.mark.parametrize("placement", GATHER_PLACEMENTS)
def test_all_gather_and_reduce_scatter_in_place(pool: RankPool, daemons: list[DaemonProcess],
                                                placement: str) -> None:
    """The rank's block is the other buffer: chunks of it leave while others' land beside it."""
    where, nbytes = GATHER_PLACEMENTS[placement], 9 << 20
    inputs = [make_input(52, r, nbytes * 4, "u8", "sum") for r in range(4)]
    full = reduce_reference(inputs, "u8", "sum").tobytes()  # (u8 sums wrap: any grouping gives it)
    results = run(pool, specs(daemons, where), workers.in_place_and_overlapping, nbytes, 52)
    for rank, result in enumerate(results):
        assert isinstance(result, tuple)
        gathered, reduced, errors = result
        assert gathered == b"".join(inputs[r][r * nbytes:(r + 1) * nbytes].tobytes() for r in range(4))
        assert reduced == full[rank * nbytes:(rank + 1) * nbytes]
        assert [e.split(":")[0] for e in errors] == ["MisuseError"] * 2


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("share,dtype", [(0, None), (1001, None), (1 << 20, None), (333, "f32")])
def test_reduce_scatter(pool: RankPool, daemons: list[DaemonProcess], placement: str, share: int,
                        dtype: str | None) -> None:
    where = PLACEMENTS[placement]
    results = run(pool, specs(daemons, where), workers.reduce_scatter, share, dtype, None, 4)
    d = dtype or "u8"
    full = grouped_reference([make_input(4, r, share * 4, d, "sum") for r in range(4)], d, "sum",
                             groups(where))
    for rank, raw in enumerate(results):
        assert raw == full[rank * share:(rank + 1) * share].tobytes()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("nbytes", [0, 4, 5 * CHUNK_BYTES + 1])  # more chunks than a window
def test_broadcast_from_every_root(pool: RankPool, daemons: list[DaemonProcess], placement: str,
                                   nbytes: int) -> None:
    addresses = specs(daemons, PLACEMENTS[placement])
    for root in range(4):
        results = run(pool, addresses, workers.broadcast, nbytes, root, 5)
        assert all(raw == make_input(5, root, nbytes, "u8", "sum").tobytes() for raw in results), root


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_barrier_waits_for_every_daemon(pool: RankPool, daemons: list[DaemonProcess], placement: str) -> None:
    times = run(pool, specs(daemons, PLACEMENTS[placement]), workers.barrier, 0.15)
    last = max(arrived for arrived, _ in times)  # type: ignore[misc]
    assert all(left >= last - 0.005 for _, left in times)  # type: ignore[misc]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("nbytes", [2, 1001, 5 << 20, 5 * CHUNK_BYTES + 3])
def test_send_recv_every_pair(pool: RankPool, daemons: list[DaemonProcess], placement: str,
                              nbytes: int) -> None:
    results = run(pool, specs(daemons, PLACEMENTS[placement]), workers.send_recv_pairs, nbytes, 6)
    for rank, received in enumerate(results):
        assert isinstance(received, dict) and sorted(received) == [r for r in range(4) if r != rank]
        for peer, raw in received.items():
            assert raw == make_input(6 + 1000 * peer + rank, 0, nbytes, "u8", "sum").tobytes()


def test_send_recv_ungrouped_through_the_root(pool: RankPool, daemons: list[DaemonProcess]) -> None:
    where = PLACEMENTS["1+1+2"]  # rank 0 on A (root), rank 3 on C: ranks 1->... via A
    results = run(pool, specs(daemons, where), workers.send_then_recv, 4097, 8)
    assert results[0] == make_input(8, 3, 4097, "u8", "sum").tobytes()
    assert results[3] == make_input(8, 0, 4097, "u8", "sum").tobytes()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_recv_command_and_groups(pool: RankPool, daemons: list[DaemonProcess], placement: str) -> None:
    addresses = specs(daemons, PLACEMENTS[placement])
    commands = [3, 0xFFFFFFFF, 17]
    assert run(pool, addresses, workers.command_loop, commands) == [commands] * 4
    results = run(pool, addresses, workers.group_two_reduces, 513, 12)
    want_b = reduce_reference([make_input(13, r, 513, "i32", "max") for r in range(4)], "i32", "max")
    want_a = grouped_reference([make_input(12, r, 513, "f32", "sum") for r in range(4)], "f32", "sum",
                               groups(PLACEMENTS[placement]))
    assert all(res == (want_a.tobytes(), want_b.tobytes()) for res in results)


def test_symmetric_alloc_and_identity(pool: RankPool, daemons: list[DaemonProcess]) -> None:
    where = PLACEMENTS["2+2"]
    addresses = specs(daemons, where)
    assert run(pool, addresses, workers.identity) == [(r, 4, True, 1) for r in range(4)]
    want = grouped_reference([make_input(14, r, 1000, "f32", "sum") for r in range(4)], "f32", "sum",
                             groups(where))
    for res in run(pool, addresses, workers.symmetric, 1000, 14):
        assert isinstance(res, dict) and res["result"] == want.tobytes()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_attempt_reconnect_advances_every_daemon(pool: RankPool, daemons: list[DaemonProcess],
                                                 placement: str) -> None:
    where = PLACEMENTS[placement]
    results = run(pool, specs(daemons, where), workers.reconnect_all, 15)
    want = grouped_reference([make_input(15, r, 64, "f32", "sum") for r in range(4)], "f32", "sum",
                             groups(where))
    assert all(res == (1, 2, want.tobytes()) for res in results)


def test_two_worlds_share_the_daemons(pool: RankPool, daemons: list[DaemonProcess]) -> None:
    """World x on daemons A+B and world y on B+C, at the same time, 2 ranks each."""
    x, y = world_name("x"), world_name("y")
    a, b, c = (str(d.socket_path) for d in daemons)
    root_x, root_y = daemons[0].peer_address(), daemons[1].peer_address()
    places = [(a, root_x, x, 0, 21), (b, root_x, x, 1, 21), (b, root_y, y, 0, 22), (c, root_y, y, 1, 22)]
    args = [(f"{sock}@{root}", world, rank, 2, 2000, "i32", "sum", seed)
            for sock, root, world, rank, seed in places]
    results = [o.unwrap() for o in pool.run(workers.all_reduce, args)]
    want_x = reduce_reference([make_input(21, r, 2000, "i32", "sum") for r in range(2)], "i32", "sum")
    want_y = reduce_reference([make_input(22, r, 2000, "i32", "sum") for r in range(2)], "i32", "sum")
    assert results == [want_x.tobytes()] * 2 + [want_y.tobytes()] * 2


@pytest.mark.parametrize(("what", "placement", "late"), [
    ("p2p", [0, 1], 0),  # a member sends to the root's rank
    ("p2p", [0, 1], 1),  # the root sends to a member's rank
    ("p2p", [0, 1, 2], 2),  # member to member, through the root
    ("all_reduce", [0, 1], 0),  # a member's partial sums wait for the root's rank (and the
    # root's results must not pile up at the member while it sends them)
])
def test_a_late_reader_holds_back_the_sender(pool: RankPool, daemons: list[DaemonProcess], what: str,
                                             placement: list[int], late: int) -> None:
    """Data sent before its reader calls waits in the reader's daemon, a window of it at
    most (nor does any other daemon of the world pile it up): the sender goes on as the
    reader takes it, and every byte arrives."""
    # (the sender is at its call within milliseconds of the barrier: 1 s of delay is many of the
    # test's looks at a full window)
    nbytes, delay, seed = 12 * CHUNK_BYTES + 5, 1.0, 31
    world, addresses = world_name("late"), specs(daemons, placement)
    involved = sorted(set(placement))
    reader = placement[late]
    workers_started = pool.start(workers.late_taker, [(addresses[r], world, r, len(placement), what, nbytes,
                                                       late, delay, seed) for r in range(len(placement))])
    held: dict[int, list[int]] = {d: [] for d in involved}
    scraped = None
    deadline = time.monotonic() + delay + 20
    while time.monotonic() < deadline:
        statuses = {d: world_status(daemons[d], world) for d in involved}
        if any(status is None and held[d] for d, status in statuses.items()):
            break  # the ranks left
        for d, status in statuses.items():
            if status is not None and status["state"] == "ready":
                held[d].append(int(status["peer_bytes_held"]))  # type: ignore[call-overload]
        if scraped is None and held[reader] and held[reader][-1]:
            scraped = scrape(str(query_status(str(daemons[reader].socket_path), 5)["metrics"]))
        time.sleep(0.05)
    results = [o.unwrap() for o in pool.collect(workers_started, timeout=30)]
    assert CHUNK_BYTES <= max(held[reader]) <= WINDOW_CHUNKS * CHUNK_BYTES, max(held[reader])
    for d in involved:
        assert max(held[d]) <= WINDOW_CHUNKS * CHUNK_BYTES and held[d][-1] == 0, (d, held[d])
    assert scraped is not None
    assert 0 < scraped[("commd_peer_bytes_held", ())] <= WINDOW_CHUNKS * CHUNK_BYTES
    inputs = [make_input(seed, r, nbytes, "u8", "sum") for r in range(len(placement))]
    if what == "all_reduce":
        assert results == [reduce_reference(inputs, "u8", "sum").tobytes()] * len(placement)
    else:
        assert results[late] == inputs[0 if late == 1 else 1].tobytes()


def test_a_failed_world_lets_go_of_what_it_can_no_longer_read(pool: RankPool, daemons: list[DaemonProcess],
                                                               tmp_path: Path) -> None:
    """A send that times out because its receive never came leaves a window of data at the
    receiver's daemon: once the world failed and no op of it runs, that goes, though the
    ranks stay connected (before, it stayed until every rank reconnected or left)."""
    world, addresses = world_name("unread"), specs(daemons, [0, 1])
    released = tmp_path / "released"  # (the ranks stay connected until the status was read)
    started = pool.start(workers.send_unreceived, [(addresses[r], world, r, 2, 6 * CHUNK_BYTES,
                                                    str(released), 8.0) for r in range(2)])
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + 7.0
    while time.monotonic() < deadline:
        status = world_status(daemons[0], world)
        if status is not None:
            seen.append((str(status["state"]), int(status["peer_bytes_held"])))  # type: ignore[call-overload]
            if seen[-1][0] == "failed" and len([s for s in seen if s[0] == "failed"]) >= 3:
                break
        time.sleep(0.1)
    released.touch()
    results = [o.unwrap() for o in pool.collect(started, timeout=30)]
    assert results == ["-", "CommTimeout"]
    assert max(held for state, held in seen if state == "ready") > 0  # the window did come
    assert [held for state, held in seen if state == "failed"][-3:] == [0, 0, 0], seen


def test_a_call_for_an_ended_epoch_is_refused_on_every_daemon(daemons: list[DaemonProcess]) -> None:
    """Two ranks on two daemons reconnect (the root picks the epoch, the member learns it):
    a call made for the epoch before is refused as stale on either daemon, and calls for
    the new epoch then match across them."""
    world, root = world_name("multi"), daemons[0].peer_address()
    ranks = [RawClient(str(daemons[d].socket_path)) for d in (0, 1)]
    try:
        for r, raw in enumerate(ranks):
            raw.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, r, 2, 10_000,
                                 bootstrap=root))
        welcomes = [raw.recv() for raw in ranks]
        assert all(isinstance(w, proto.Welcome) for w in welcomes), welcomes
        epoch = welcomes[0].epoch  # type: ignore[union-attr]
        for raw in ranks:
            raw.send(proto.Reconnect(2))
        for raw in ranks:
            replies = [raw.recv(), raw.recv()]  # the vote fails the world; then the new epoch
            assert replies[-1] == proto.Ok(2, value=epoch + 1), replies
        for r, raw in enumerate(ranks):
            raw.send(proto.Submit(3, (proto.Barrier(),), epoch))
            err = raw.error()
            assert (err.id, err.code) == (3, proto.ErrorCode.STALE_EPOCH), (r, err)
        for raw in ranks:
            raw.send(proto.Submit(4, (proto.Barrier(),), epoch + 1))
        assert [raw.recv() for raw in ranks] == [proto.Ok(4), proto.Ok(4)]
    finally:
        for raw in ranks:
            raw.close()
