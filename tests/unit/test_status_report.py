"""What `commd status` gets when the daemon's report would not fit one packet."""

from __future__ import annotations

from typing import Any

import pytest

import proto
from commd.session import _fitting_report
from commd.status import render_status

pytestmark = pytest.mark.timeout(30)


def world(name: str, ranks: int, calls: int) -> dict[str, Any]:
    recent = {str(r): [{"seq": s, "state": "done", "seconds": 0.001,
                        "call": f"all_reduce(bytes={s * 1024}, dtype=bf16, op=sum)"} for s in range(calls)]
              for r in range(ranks)}
    return {"name": name, "state": "ready", "epoch": 1, "world_size": ranks, "ranks": list(range(ranks)),
            "waiting": [], "pending_calls": 0, "cause": None, "recent_calls": recent}


def fits(report: proto.StatusReport) -> bool:
    return len(proto.encode(report)) <= proto.MAX_MESSAGE_BYTES


def test_a_big_world_asked_for_by_name_is_shown_with_fewer_calls_not_dropped() -> None:
    """(before: a world of ~75 ranks on one daemon came back as no world at all, and the
    CLI said "no worlds")"""
    report = _fitting_report(7, {"pid": 1, "worlds": [world("big", 512, 8)]})
    assert fits(report)
    (shown,) = report.info["worlds"]
    assert shown["name"] == "big" and len(shown["ranks"]) == 512
    assert all(len(calls) <= 1 for calls in shown["recent_calls"].values())
    assert "no worlds" not in render_status(report.info)


def test_many_worlds_keep_their_rows_before_their_histories_and_the_cut_is_said() -> None:
    small = _fitting_report(1, {"pid": 1, "worlds": [world(f"w{i}", 2, 8) for i in range(3)]})
    assert [len(c) for w in small.info["worlds"] for c in w["recent_calls"].values()] == [8] * 6
    many = [world(f"w{i:05d}", 4, 8) for i in range(3000)]
    report = _fitting_report(2, {"pid": 1, "worlds": many})
    assert fits(report) and report.info["worlds_total"] == 3000
    shown = report.info["worlds"]
    assert 0 < len(shown) < 3000 and all(not any(w["recent_calls"].values()) for w in shown)
    assert f"{len(shown)} of 3000 worlds shown" in render_status(report.info)
