"""`commd bench` end to end with tiny settings: it runs, prints its table, writes its JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    has_torch = importlib.util.find_spec("torch") is not None
    cmd = [sys.executable, "-m", "commd", "bench", "--ranks", "2", "--sizes", "8,4096",
           "--iters", "20", "--json", str(out)]
    if not has_torch:
        cmd.append("--no-gloo")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "commd med µs" in proc.stdout and "targets:" in proc.stdout

    report = json.loads(out.read_text())
    rows = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert set(rows) == {("all_reduce", 8), ("all_reduce", 4096), ("barrier", 0)}
    for row in rows.values():
        assert row["ranks"] == 2
        assert row["commd"]["median_us"] > 0 and row["commd"]["iters"] == 20
        if has_torch:
            assert row["gloo"]["median_us"] > 0
            assert row["latency_ratio"] > 0
    assert report["machine"]["cpu_count"] >= 1


@pytest.mark.timeout(180)
def test_bench_smoke_two_daemons(tmp_path: Path) -> None:
    """--daemons 2: 4 ranks in blocks of 2 over 2 daemons joined by their peer listeners."""
    out = tmp_path / "b2.json"
    cmd = [sys.executable, "-m", "commd", "bench", "--daemons", "2", "--ranks", "4",
           "--sizes", "8,4096", "--iters", "10", "--no-gloo", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks / 2 daemons" in proc.stdout and "over 2 daemons" in proc.stdout

    report = json.loads(out.read_text())
    assert report["settings"]["daemons"] == 2
    rows = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert set(rows) == {("all_reduce", 8), ("all_reduce", 4096), ("barrier", 0)}
    for row in rows.values():
        assert (row["ranks"], row["daemons"], row["placement"]) == (4, 2, [0, 0, 1, 1])
        assert row["world"] == "4 ranks / 2 daemons"
        assert row["commd"]["median_us"] > 0 and row["commd"]["iters"] == 10
        assert row["gloo"] is None
    [target] = report["targets"]
    assert (target["ranks"], target["daemons"], target["goal"]) == (4, 2, 1.5)
    assert target["met"] is None and target["verdict"] == "not measured"  # no 64 MiB row here
