"""Shared fixtures: a real daemon process and a pool of real worker processes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.launch import DaemonProcess
from tests.integration.harness import RankPool, short_tmpdir


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonProcess]:
    tmp = short_tmpdir()
    log = open(Path(tmp) / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    proc = DaemonProcess(Path(tmp) / "run" / "commd.sock", log=log)
    proc.start()
    try:
        yield proc
    finally:
        code = proc.stop()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        assert code == 0, f"daemon exited with {code}"


@pytest.fixture(scope="session")
def pool() -> Iterator[RankPool]:
    workers = RankPool(4)
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
def sock(daemon: DaemonProcess) -> str:
    return str(daemon.socket_path)
