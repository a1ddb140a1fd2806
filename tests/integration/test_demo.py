"""`commd demo`, the README's main job, end to end: a daemon, worker processes, every
result checked against numpy by the demo itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_the_demo_runs_and_every_result_matches_numpy(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "commd", "demo", "--ranks", "3", "--steps", "5",
                           "--layers", "2", "--hidden", "1000", "--timeout", "30"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every result matched numpy; daemon exited with code 0" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
