"""scripts/gpu_check.py's imports step runs once, on a GPU machine, with no rerun to spare:
its probe code runs here too, so a probe that breaks with the code it probes (a renamed
call, say) is found in CI, not on the device."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def probe_results() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
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
