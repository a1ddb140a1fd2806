"""scripts/gpu_check.py's imports step runs once, on a GPU machine, with no rerun to spare:
its probe code runs here too, so a probe that breaks with the code it probes (a renamed
call, say) is found in CI, not on the device."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from commd.engine.base import BarrierOp
from commd.engine.nccl import NcclEngine
from commd.engine.stuckwatch import StuckWatch
from tests.contract.fakegpu import FakeGpu

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def probe_results() -> dict[str, Any]:
    module = gpu_check()
    done = subprocess.run([sys.executable, "-c", module.IMPORTS, "host"], capture_output=True, text=True,
                          timeout=100)
    line = next(line for line in done.stdout.splitlines() if line.startswith("@@RESULT "))
    info: dict[str, Any] = json.loads(line.removeprefix("@@RESULT "))
    return info


def test_the_imports_step_probes_what_runs_without_a_gpu() -> None:
    info = probe_results()
    assert info["sealing"] == "ok"  # two daemons seal their frames: cryptography and cffi work
    assert info["engine"] == "host"
    assert set(info["repo"]) == {"commd", "client", "proto"}
    assert info["dists"]["cryptography"] and info["dists"]["cffi"]


async def test_the_fault_step_reads_how_long_the_engines_abort_took(caplog: pytest.LogCaptureFixture) -> None:
    """Step 6 reports the longest ncclCommAbort from the daemons' logs: it reads the line
    the NCCL engine writes (here over the fake device), so a reworded log is found here."""
    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    engine = NcclEngine(FakeGpu(), stuck=StuckWatch(7.0))
    try:
        comm = engine.communicator("w", 1, 1, [0])
        await comm.run(BarrierOp((0,)))
        comm.abort()
        for _ in range(500):
            if any("ncclCommAbort of" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
    finally:
        engine.close()
    log = "\n".join(record.getMessage() for record in caplog.records)
    ctx = types.SimpleNamespace(daemon_logs=["==== daemon of an earlier step", log])
    assert gpu_check().abort_note(ctx, 1) == "abort 0.00 s"
    assert gpu_check().abort_note(ctx, 2) == "no abort logged"


def test_the_nccl_warnings_of_the_daemons_logs_are_counted_once_each() -> None:
    """The run's end lists NCCL's WARN lines (without their per-process prefix) by count, so
    a warning about how commd drives NCCL is seen in the one device run's output."""
    logs = ["h1:10:11 [0] NCCL INFO Bootstrap\nh1:10:12 [0] NCCL WARN Attempt to use communicator "
            "before the previous operation returned ncclSuccess\ncommd: world ready",
            "h1:20:21 [0] NCCL WARN Attempt to use communicator before the previous operation "
            "returned ncclSuccess\nh1:20:21 [0] NCCL WARN Cuda failure 'invalid argument'"]
    assert gpu_check().nccl_warnings(logs) == [
        "2x NCCL WARN Attempt to use communicator before the previous operation returned ncclSuccess",
        "1x NCCL WARN Cuda failure 'invalid argument'"]
    assert gpu_check().nccl_warnings(["commd: no warnings here"]) == []
