"""JSON log lines, the daemon's counters and their Prometheus exposition."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

import proto
from commd.logs import Throttled, ThrottledBy, setup_logging
from commd.recorder import FlightRecorder
from commd.stats import LATENCY_BOUNDS, DaemonStats

pytestmark = pytest.mark.timeout(10)
MEM = proto.Mem(1, 0)


@pytest.fixture
def restore_logging() -> object:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield None
    root.handlers[:] = handlers
    root.setLevel(level)


def test_throttled_warnings_log_one_an_interval_and_count_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttled = Throttled(logging.getLogger("commd.test"), interval_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "commd.test"):
        for when, pid in [(100.0, 1), (100.2, 2), (100.9, 3), (101.0, 4), (101.5, 5), (103.0, 6)]:
            now[0] = when
            throttled.warning("bad packet from pid %d: %s", pid, "garbage")
    assert [r.getMessage() for r in caplog.records] == [
        "bad packet from pid 1: garbage",
        "bad packet from pid 4: garbage (2 more like it since the last such line were not logged)",
        "bad packet from pid 6: garbage (1 more like it since the last such line were not logged)",
    ]
    assert throttled.left_out == 0


def test_throttled_by_source_bounds_each_source_and_new_ones_past_its_room(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttled = ThrottledBy(logging.getLogger("commd.test"), interval_s=1.0, clock=lambda: now[0],
                            sources=2)
    with caplog.at_level(logging.WARNING, "commd.test"):
        for when, source in [(100.0, "a"), (100.1, "a"), (100.2, "b"), (100.3, "c"), (100.4, "d"),
                             (101.5, "e"), (101.6, "a")]:
            now[0] = when
            throttled.warning(source, "dropped %s", source)
    assert [r.getMessage() for r in caplog.records] == [
        "dropped a",
        "dropped b",  # (another source: not left out for a's line)
        "dropped c",  # (no room for a third: c and d share one)
        "dropped e",  # (b was quiet, so e took its room; a still counts one left out)
        "dropped a (1 more like it since the last such line were not logged)",
    ]


def test_json_lines_carry_world_epoch_rank(restore_logging: object) -> None:
    out = io.StringIO()
    setup_logging("INFO", "json", out)
    log = logging.getLogger("commd.world")
    log.info("world %s epoch %d: ready", "w1", 3, extra={"world": "w1", "epoch": 3})
    log.warning("world %s epoch %d: mismatch", "w1", 3, extra={"world": "w1", "epoch": 3, "rank": 1})
    log.debug("not shown")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("plain line")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    assert lines[0]["message"] == "world w1 epoch 3: ready"
    assert (lines[0]["level"], lines[0]["logger"], lines[0]["world"], lines[0]["epoch"]) == (
        "INFO", "commd.world", "w1", 3)
    assert "rank" not in lines[0] and lines[1]["rank"] == 1
    assert lines[0]["ts"].endswith("Z") and "T" in lines[0]["ts"]
    assert "world" not in lines[2] and "ValueError: boom" in lines[2]["exc"]


def test_text_lines_by_default(restore_logging: object) -> None:
    out = io.StringIO()
    setup_logging("INFO", "text", out)
    logging.getLogger("commd").info("hello %s", "there")
    assert out.getvalue().rstrip().endswith("INFO commd: hello there")


def test_a_text_line_is_one_line_whatever_text_it_carries(restore_logging: object) -> None:
    """Text a peer daemon sends (a failure message, a goodbye's reason) went into the line
    as it was: a line break in it started a forged line ("... WARNING commd.world: ...")."""
    out = io.StringIO()
    setup_logging("INFO", "text", out)
    log = logging.getLogger("commd.peering")
    said = "bye\n2026-12-08 00:00:00,000 WARNING commd.world: forged\r\x1b[2J\tx"
    log.info("daemon %s said goodbye: %s", "B", said)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("with a traceback")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("INFO commd.peering: daemon B said goodbye: bye\\n2026-12-08 00:00:00,000 "
                             "WARNING commd.world: forged\\r\\x1b[2J\tx"), lines
    assert lines[1].endswith("ERROR commd.peering: with a traceback")
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom"


def test_counters_by_op_outcome_bytes_and_latency() -> None:
    stats = DaemonStats()
    recorder = FlightRecorder(depth=2, stats=stats.calls)  # the ring is small; the counts are not
    for _ in range(5):
        recorder.start(0, proto.AllReduce(MEM, 64)).close("done")
    recorder.start(0, proto.AllReduce(MEM, 64)).close("failed")
    recorder.start(0, proto.Barrier()).close("done")
    record = recorder.start(1, proto.Broadcast(MEM, 4, root=0, command=True))
    record.close("done")
    record.close("failed")  # a record closes once: counted once
    calls = stats.summary()["calls"]
    assert calls["all_reduce"]["done"] == 5 and calls["all_reduce"]["failed"] == 1
    assert calls["all_reduce"]["bytes"] == 5 * 64
    assert calls["barrier"] == {"done": 1, "failed": 0, "bytes": 0, "seconds": calls["barrier"]["seconds"]}
    assert calls["recv_command_u32"]["done"] == 1
    buckets = stats.calls.by_op["all_reduce"].cumulative()
    assert len(buckets) == len(LATENCY_BOUNDS) + 1 and buckets[-1] == ("+Inf", 5)
    assert [count for _, count in buckets] == sorted(count for _, count in buckets)


def test_world_failures_and_last_failure() -> None:
    stats = DaemonStats()
    stats.transition("ready")
    stats.transition("failed")
    stats.count_failure("w", 2, proto.ErrorCode.MISMATCH, "rank 1 called barrier")
    assert stats.summary()["world_failures"] == {"MISMATCH": 1}
    assert stats.summary()["world_transitions"] == {"failed": 1, "ready": 1}
    assert stats.last_failure["w"]["code"] == "MISMATCH" and stats.last_failure["w"]["epoch"] == 2
    stats.forget("w")
    assert "w" not in stats.last_failure


def test_prometheus_exposition() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from commd.metrics import renderer

    stats = DaemonStats()
    recorder = FlightRecorder(stats=stats.calls)
    for _ in range(3):
        recorder.start(0, proto.AllGather(MEM, MEM, 16)).close("done")
    stats.count_failure("w", 1, proto.ErrorCode.TIMEOUT, "late")
    registry = SimpleNamespace(stats=stats, worlds={}, connected_ranks=lambda: 2)
    server = SimpleNamespace(registry=registry, sessions={1, 2, 3}, cluster=None, uptime=lambda: 1.5)
    text = renderer(server)().decode()  # type: ignore[arg-type]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("commd_calls_total", (("op", "all_gather"), ("outcome", "done")))] == 3
    assert samples[("commd_call_bytes_total", (("op", "all_gather"),))] == 48
    assert samples[("commd_call_latency_seconds_count", (("op", "all_gather"),))] == 3
    assert samples[("commd_world_failures_total", (("cause", "TIMEOUT"),))] == 1
    assert samples[("commd_connections", ())] == 3
    assert samples[("commd_ranks_connected", ())] == 2
