"""Seeded random programs of every call (tests/integration/programs.py) on real ranks:
one daemon, and two daemons with the ranks split between them; every byte each rank
holds after each step (and the guard after it) checked against numpy. A failing seed
reruns alone with `-k 'seed-N]'`; more seeds: RANDOM_PROGRAM_SEEDS=first:last."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.launch import DaemonProcess
from tests.integration import programs
from tests.integration.harness import RankPool, short_tmpdir, world_name

pytestmark = pytest.mark.timeout(120)

SECRET = {"COMMD_PEER_SECRET": "test-secret-0123456789"}


def _seeds(default: range) -> range:
    given = os.environ.get("RANDOM_PROGRAM_SEEDS")
    if not given:
        return default
    first, last = given.split(":")
    return range(int(first), int(last))


@pytest.fixture(scope="module")
def two_daemons() -> Iterator[list[DaemonProcess]]:
    tmp = short_tmpdir()
    procs = []
    try:
        for name in "AB":
            procs.append(DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", name]).start())
        yield procs
    finally:
        for proc in procs:
            assert proc.stop() == 0
        shutil.rmtree(tmp, ignore_errors=True)


def check(pool: RankPool, seed: int, addresses: list[str], groups: list[list[int]], big: int) -> None:
    n = len(addresses)
    program = programs.generate(seed, n, big=big)
    world = world_name("random")
    outcomes = pool.run(programs.run, [(addresses[r], world, r, n, seed, program) for r in range(n)],
                        timeout=90)
    want = programs.expected(program, seed, n, groups)
    for rank, outcome in enumerate(outcomes):
        got = outcome.unwrap()
        assert [g[:3] for g in got] == [w[:3] for w in want[rank]], f"seed {seed} rank {rank}"
        for (s, i, role, raw), (_, _, _, wanted) in zip(got, want[rank], strict=True):
            how = "group" if program[s].grouped else "alone"
            assert raw == wanted, f"seed {seed} rank {rank} step {s} ({how}) {role} of {program[s].items[i]}"


@pytest.mark.parametrize("seed", _seeds(range(12)), ids=lambda s: f"seed-{s}")
def test_one_daemon(pool: RankPool, sock: str, seed: int) -> None:
    n = random.Random(seed).randint(1, 4)
    check(pool, seed, [sock] * n, [list(range(n))], big=300_000)


def split_over(daemons: list[DaemonProcess], seed: int) -> tuple[list[str], list[list[int]]]:
    """2-4 ranks placed at random on two daemons (each holds one at least), rank 0's daemon
    the root: each rank's address, and each daemon's ranks."""
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    placement = [0, 1] + [rng.randrange(2) for _ in range(n - 2)]
    rng.shuffle(placement)
    root = daemons[placement[0]].peer_address()
    addresses = [f"{daemons[d].socket_path}@{root}" for d in placement]
    return addresses, [[r for r in range(n) if placement[r] == d] for d in (0, 1)]


@pytest.mark.parametrize("seed", _seeds(range(6)), ids=lambda s: f"seed-{s}")
def test_two_daemons(pool: RankPool, two_daemons: list[DaemonProcess], seed: int) -> None:
    check(pool, seed, *split_over(two_daemons, seed), big=(4 << 20) + 3)  # past one chunk between daemons


def disagree(pool: RankPool, seed: int, addresses: list[str], groups: list[list[int]]) -> None:
    """One call of one rank changed: every rank gets the MismatchError, which names the
    call's index and that rank (and for a transfer, its peer); after attempt_reconnect on
    every rank, another program runs right."""
    n = len(addresses)
    rng = random.Random(seed)
    program = programs.generate(seed, n, steps=12, big=1000)
    # one call of one rank, not a transfer to itself (both its sides would change alike)
    candidates = [(s, rank, i) for s, step in enumerate(program) for rank in range(n)
                  for i, _ in step.orders[rank]
                  if step.items[i].kind != "transfer" or step.items[i].src != step.items[i].dst]
    s, rank, i = rng.choice(candidates)
    item = program[s].items[i]
    change = (s, rank, i, programs.changed(rng, item, n, rank))

    def kind_of(it: programs.Item) -> object:
        return (it.src, it.dst) if it.kind == "transfer" else "collective"

    index = sum(kind_of(it) == kind_of(item) for step in program[:s] for it in step.items) \
        + sum(kind_of(it) == kind_of(item) for it in program[s].items[:i])
    if item.kind == "transfer":
        want = f"mismatched point-to-point {item.src}->{item.dst} call {index}: "
        named = [f"rank {item.src} called send_to(", f"rank {item.dst} called recv_from("]
    else:
        want, named = f"mismatched collective call {index}: ", [f"rank {rank} called "]
    then = programs.generate(seed + 1, n, steps=8, big=1000)
    world = world_name("disagree")
    outcomes = pool.run(programs.run_after_mismatch, [(addresses[r], world, r, n, seed, program, change, then)
                                                      for r in range(n)], timeout=90)
    after = programs.expected(then, seed + 1, n, groups)
    for r, outcome in enumerate(outcomes):
        context = f"seed {seed} rank {r} ({rank} changed {item} to {change[3]})"
        error, results = outcome.unwrap()
        assert error.startswith("MismatchError (mismatch): "), (context, error)
        assert want in error and all(name in error for name in named), (context, error)
        # the rebuilt world matches from call 0 again, on every daemon
        assert results == after[r], f"{context}: after the rebuild"


@pytest.mark.parametrize("seed", _seeds(range(12)), ids=lambda s: f"seed-{s}")
def test_one_disagreement_one_daemon(pool: RankPool, sock: str, seed: int) -> None:
    n = random.Random(seed).randint(2, 4)
    disagree(pool, seed, [sock] * n, [list(range(n))])


@pytest.mark.parametrize("seed", _seeds(range(6)), ids=lambda s: f"seed-{s}")
def test_one_disagreement_two_daemons(pool: RankPool, two_daemons: list[DaemonProcess], seed: int) -> None:
    disagree(pool, seed, *split_over(two_daemons, seed))
