"""The flight recorder's view of open calls, which the world's watchdog times out."""

from __future__ import annotations

import time

import pytest

import proto
from commd.recorder import FlightRecorder
from commd.watchdog import by_call
from proto import peer as p

pytestmark = pytest.mark.timeout(30)


def test_the_oldest_open_call_is_found_past_the_ring() -> None:
    """A rank with more calls open than the ring keeps (async sends to a peer that stalled):
    the watchdog must judge the oldest, not the oldest the ring still shows (before, a
    call's deadline was judged by the start of one 32 calls newer: late by their spacing)."""
    recorder = FlightRecorder(depth=4)
    first = recorder.start(0, proto.Send(proto.Mem(1, 0), 8, 1))
    later = [recorder.start(0, proto.Send(proto.Mem(1, 0), 8, 1)) for _ in range(10)]
    recorder.start(1, proto.Recv(proto.Mem(2, 0), 0, 0)).close("done")
    assert recorder.oldest_open() is first
    assert [r["seq"] for r in recorder.dump()["0"]] == [7, 8, 9, 10]  # (the ring: the newest)
    first.close("failed")
    assert recorder.oldest_open() is later[0]
    for record in later:
        record.close("done")
    assert recorder.oldest_open() is None


def test_calls_that_wait_for_ever_are_never_the_oldest_open() -> None:
    recorder = FlightRecorder()
    recorder.start(1, proto.Broadcast(proto.Mem(1, 0), 4, 0, command=True))  # recv_command_u32
    assert recorder.oldest_open() is None
    barrier = recorder.start(0, proto.Barrier())
    assert recorder.oldest_open() is barrier


def test_the_status_shows_an_ended_call_as_it_ended_and_an_open_one_as_it_is_now() -> None:
    """An ended call's entry is made once (the status of hundreds of worlds described the
    same ended calls again each time); an open one's state and age are read anew."""
    recorder = FlightRecorder()
    ended = recorder.start(0, proto.AllReduce(proto.Mem(1, 0), 8, proto.DType.F32))
    ended.close("done")
    running = recorder.start(1, proto.Barrier())
    first = recorder.dump()
    time.sleep(0.05)
    running.state = "running"
    again = recorder.dump()
    assert again["0"] == first["0"] == [{"rank": 0, "seq": 0, "state": "done", "at": first["0"][0]["at"],
                                         "seconds": first["0"][0]["seconds"],
                                         "call": "all_reduce(bytes=8, dtype=f32, op=sum)"}]
    assert first["0"][0]["seconds"] < 0.05
    assert [c["state"] for c in (first["1"][0], again["1"][0])] == ["pending", "running"]
    assert again["1"][0]["seconds"] >= first["1"][0]["seconds"] + 0.05


def test_a_calls_report_names_every_rank_within_its_bounds() -> None:
    """A daemon whose 600 ranks are at 300 different calls answers a CallsQuery with at most
    MAX_CALL_GROUPS calls: the ranks of the calls past them are told as at 'one of N other
    calls', none left out (the asker would say 'not in its answer' of them), none twice."""
    recorder = FlightRecorder()
    for rank in range(600):
        for _ in range(rank // 2):
            recorder.start(rank, proto.Barrier()).close("done")
        recorder.start(rank, proto.Barrier())
    calls, ranks, call_of = by_call(recorder.newest())
    report = p.CallsReport("w", 1, 1, "a", "b", calls, ranks, call_of)  # (within the message's bounds)
    assert len(report.calls) == p.MAX_CALL_GROUPS
    assert sorted(report.ranks) == list(range(600))
    told = dict(zip(report.ranks, (report.calls[i] for i in report.call_of), strict=True))
    assert told[0] == "#0 barrier() pending" and told[2 * 254 + 1] == "#254 barrier() pending"
    assert told[2 * 255] == told[599] == "one of 45 other calls"
    long = by_call({"#0 " + "x" * 1000: [0]})[0][0]
    assert len(long) <= p.MAX_CALL_TEXT and long.endswith(" ... (cut)")


def test_the_log_dump_says_ranks_with_the_same_calls_once() -> None:
    """A failed world's flight recorder goes to the log a line per rank: with 4000 ranks at
    the same barrier that was 4000 lines a failure. Ranks with the same newest calls share
    a line; the one that differs has its own."""
    recorder = FlightRecorder()
    for rank in range(40):
        recorder.start(rank, proto.Barrier()).close("done")
        if rank != 7:
            recorder.start(rank, proto.Barrier())
    assert recorder.lines() == [
        "ranks [0-6, 8-39]: #0 barrier() done, #1 barrier() pending",  # (every rank: see test_big_worlds)
        "rank 7: #0 barrier() done",
    ]
