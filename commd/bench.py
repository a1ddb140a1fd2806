"""`commd bench`: DaemonBackend all_reduce and barrier against torch.distributed gloo.

For each rank count the bench starts one daemon and n commd workers, then n gloo
workers (spawned processes), and every rank times each call with perf_counter.
A row's latency per iteration is the slowest rank's time for that iteration (a
collective is done only when every rank has its result); the table shows the
median and p99 of that over the iterations. Throughput is algorithm bandwidth:
bytes / median seconds. Ratios are gloo / commd, so above 1 means commd is faster.

With --daemons N > 1 the commd side starts N daemons on this host, joined by their
peer listeners (127.0.0.1, a fresh random shared secret), and places the n ranks in
contiguous blocks (4 ranks over 2 daemons: ranks 0,1 on the first, 2,3 on the
second); rank 0's daemon is the world's root. The gloo side is unchanged: n processes.

Buffers hold random bf16 values in [2^-7, 2^-2); they are refilled from a pristine
copy, outside the timed call, before repeated sums could reach inf. Each size's first
call (a warm-up call, not timed) is checked on every rank, on both sides, against the
exact sum of every rank's input: a wrong sum fails the run (see benchrun.check_sum). The
worker processes live in `benchrun`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import secrets
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .benchrun import BARRIER, CpuSet, Plan, Stats, ctrl_c_after, free_port, run_side
from .config import SECRET_ENV
from .errors import ConfigError
from .launch import DaemonProcess

_STOP_TIMEOUT_S = 20.0
# (ranks, daemons, bytes, how many times better than gloo, measured as): the project's
# goals; gloo always runs one process per rank.
_TARGETS = ((2, 1, 8, 4.0, "latency"), (4, 1, 8, 4.0, "latency"),
            (4, 1, 64 << 20, 2.0, "bandwidth"))
_MULTI_TARGETS = ((4, 2, 64 << 20, 1.5, "bandwidth"),)
_CHECKED = ("each size's first (untimed) all_reduce, on every rank of both sides, against the "
            "exact sum of the ranks' inputs")


def default_iters(size: int) -> int:
    """Iterations for one size when --iters is 0.

    Enough samples for a steady p99 on the small calls, where the 2-core VM's
    scheduler noise lives; the whole default bench takes 1-2 minutes there.
    """
    for limit, iters in ((4 << 10, 10000), (64 << 10, 2000), (1 << 20, 400), (16 << 20, 50)):
        if size <= limit:
            return iters
    return 20


def size_label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def worker_cpus(n: int, cpus: Sequence[int], pin: bool) -> list[CpuSet]:
    """Each worker rank's CPU set (None: unpinned); the same for commd and gloo workers.

    Measured on the 2-core VM: one rank per core, round-robin, cut gloo's 8 B
    all_reduce at 4 ranks from ~3.4 ms to ~0.85 ms and left commd's about the same,
    so it is the fair choice. The daemon stays on all CPUs: pinning it to one core
    (workers round-robin, or all on the other core) was no faster at 8 B and up to
    40% slower at 4 MiB, where its reduction threads want both cores.
    """
    if not pin or len(cpus) < 2:
        return [None] * n
    return [(cpus[rank % len(cpus)],) for rank in range(n)]


def pinning_note(cpus: Sequence[int], pin: bool) -> str:
    if not pin:
        return "off (--no-pin)"
    if len(cpus) < 2:
        return f"off (only CPUs {list(cpus)} allowed)"
    return (f"on: rank r on CPU {list(cpus)}[r % {len(cpus)}], commd and gloo workers alike; "
            "daemon on all CPUs")


def placement(n: int, daemons: int) -> list[int]:
    """Each rank's daemon: contiguous blocks, as even as they go (4 over 2: 0, 0, 1, 1)."""
    return [rank * daemons // n for rank in range(n)]


@contextlib.contextmanager
def _daemons(tmp: Path, count: int) -> Iterator[list[DaemonProcess]]:
    """`count` daemons, with peer listeners on 127.0.0.1 and one fresh secret if more than
    one; stopped (SIGTERM, bounded wait, then SIGKILL) on the way out, whatever happened.

    Their logs go to files (a clean stop logs the links closing); a daemon's log is
    shown only when the run failed or the daemon did not exit 0 (a daemon that died
    under the run is its cause: the workers can only say their daemon went away)."""
    env = {SECRET_ENV: secrets.token_hex(16)}  # in the environment, never on a command line
    started: list[DaemonProcess] = []
    failed = False
    with contextlib.ExitStack() as logs:
        try:
            for i in range(count):
                log = logs.enter_context((tmp / f"d{i}.log").open("wb"))
                peers = ["--peer-listen", "127.0.0.1:0", "--peer-name", f"bench-{i}"] if count > 1 else []
                started.append(DaemonProcess(tmp / f"d{i}.sock", env=env, log=log, args=peers).start())
            yield started
        except KeyboardInterrupt:  # Ctrl-C reaches the daemons too: their logs are no cause
            raise
        except BaseException:
            failed = True
            raise
        finally:
            # what each logged under the run, before any stops: a clean stop logs the links
            # closing, on the other daemons too, which is no part of a failure's story (nor is a
            # daemon that stopped cleanly having logged nothing)
            logged = [(tmp / f"d{i}.log").stat().st_size for i in range(len(started))]
            with ctrl_c_after(f"stopping the daemons first (each within {2 * _STOP_TIMEOUT_S:g}s)"):
                for i, daemon in enumerate(started):
                    code = daemon.stop(_STOP_TIMEOUT_S)
                    tail = (tmp / f"d{i}.log").read_text(errors="replace")[-4000:]
                    if code != 0 or (failed and logged[i]):
                        print(f"commd bench: daemon {i} exited with code {code}; its log:\n{tail}",
                              file=sys.stderr)


def _bench_commd(n: int, daemons: int, workers: list[CpuSet], plan: Plan) -> dict[str, Stats]:
    where = placement(n, daemons)
    with tempfile.TemporaryDirectory(prefix="commd-bench-") as tmp, _daemons(Path(tmp), daemons) as procs:
        root = procs[where[0]].peer_address() if daemons > 1 else None
        return run_side("commd", [str(procs[d].socket_path) for d in where], workers, plan,
                        bootstrap=root)


def world_label(n: int, daemons: int) -> str:
    return f"{n} ranks / {daemons} daemon{'s' if daemons > 1 else ''}"


# ---- report ----------------------------------------------------------------------------


def _row(n: int, daemons: int, label: str, size: int, commd: Stats,
         gloo: Stats | None) -> dict[str, Any]:
    def side(s: Stats) -> dict[str, Any]:
        return {**dataclasses.asdict(s), "gbps": size / s.median_us / 1e3 if size else None}

    ratio = gloo.median_us / commd.median_us if gloo is not None else None
    return {"ranks": n, "daemons": daemons, "world": world_label(n, daemons),
            "placement": placement(n, daemons),
            "op": "barrier" if label == BARRIER else "all_reduce", "bytes": size,
            "label": "barrier" if label == BARRIER else size_label(size),
            "commd": side(commd), "gloo": None if gloo is None else side(gloo),
            # Same bytes on both sides, so the bandwidth ratio is the latency ratio.
            "latency_ratio": ratio, "throughput_ratio": ratio if size else None}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(rows: Sequence[dict[str, Any]], pinning: str, daemons: int = 1) -> str:
    head = ["commd DaemonBackend vs torch.distributed gloo: all_reduce (bf16, sum) and barrier",
            f"pinning: {pinning}",
            "latency: per iteration the slowest rank's time; median and p99 over the iterations",
            "lat ratio: gloo median / commd median (>1: commd faster; equals the GB/s ratio)",
            f"checked: {_CHECKED}"]
    if daemons > 1:
        head.append(f"commd: {daemons} daemons on this host, ranks in contiguous blocks, rank 0's "
                    "daemon the root; gloo: one process per rank")
    cols = ("ranks", "op/size", "commd med µs", "commd p99 µs", "gloo med µs", "gloo p99 µs",
            "lat ratio", "commd GB/s", "gloo GB/s")
    width = max([12, *(len(r["world"]) for r in rows)]) if daemons > 1 else 12
    lines = [*head, "  ".join(f"{c:>{width if i == 0 else 12}}" for i, c in enumerate(cols))]
    for r in rows:
        c, g = r["commd"], r["gloo"] or {}
        first = r["world"] if daemons > 1 else str(r["ranks"])
        cells = (_fmt(c["median_us"], ".1f"), _fmt(c["p99_us"], ".1f"),
                 _fmt(g.get("median_us"), ".1f"), _fmt(g.get("p99_us"), ".1f"),
                 _fmt(r["latency_ratio"], ".2f"), _fmt(c["gbps"], ".3g"), _fmt(g.get("gbps"), ".3g"))
        lines.append("  ".join([f"{first:>{width}}", f"{r['label']:>12}",
                                *(f"{cell:>12}" for cell in cells)]))
    return "\n".join(lines)


def _target_name(n: int, daemons: int, size: int, goal: float, what: str) -> str:
    if daemons == 1:
        return f"{size_label(size)} all_reduce, {n} ranks: {what} >= {goal:g}x gloo's"
    blocks = "+".join(str(placement(n, daemons).count(d)) for d in range(daemons))
    if len(set(blocks.split("+"))) == 1:
        blocks = f"{daemons}x{n // daemons}"
    return (f"{size_label(size)} bf16 all_reduce over {daemons} daemons ({blocks} ranks): "
            f"{what} >= {goal:g}x gloo's with {n} processes")


def check_targets(rows: Sequence[dict[str, Any]], daemons: int = 1) -> list[dict[str, Any]]:
    """The project's goals for this bench (single- or multi-daemon), each with a verdict."""
    out = []
    for n, d, size, goal, what in _TARGETS if daemons == 1 else _MULTI_TARGETS:
        key = (n, d, "all_reduce", size)
        row = next((r for r in rows if (r["ranks"], r["daemons"], r["op"], r["bytes"]) == key),
                   None)
        ratio = row["latency_ratio"] if row is not None else None
        if row is None or ratio is None:
            verdict = "not measured" if row is None else "no gloo numbers"
        else:
            c, g = row["commd"], row["gloo"]
            detail = (f"commd {c['gbps']:.3f} GB/s vs gloo {g['gbps']:.3f} GB/s" if what == "bandwidth"
                      else f"commd {c['median_us']:.1f} µs vs gloo {g['median_us']:.1f} µs")
            verdict = f"{detail} = {ratio:.2f}x: {'met' if ratio >= goal else 'NOT met'}"
        out.append({"target": _target_name(n, d, size, goal, what), "ranks": n, "daemons": d,
                    "goal": goal, "ratio": ratio, "met": None if ratio is None else ratio >= goal,
                    "verdict": verdict})
    return out


def _machine(pinning: str, torch_version: str | None) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "machine": platform.machine(), "platform": platform.platform(),
        "python": sys.version.split()[0], "numpy": np.__version__, "torch": torch_version,
        "pinning": pinning, "load_average": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what}: empty")
    return values


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def _check_writable(path: str) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"--json: {path} is a directory")
    if os.path.exists(path):
        writable = os.access(path, os.W_OK)
    else:  # a new file: where it would go (a dangling symlink's target included)
        writable = os.access(os.path.dirname(os.path.realpath(path)), os.W_OK)
    if not writable:
        raise ConfigError(f"--json: cannot write {path}")


def run_bench(args: argparse.Namespace) -> int:
    ranks = _parse_ints(args.ranks, "--ranks")
    sizes = _parse_ints(args.sizes, "--sizes")
    daemons = int(getattr(args, "daemons", 1))
    if any(n < 1 for n in ranks):
        raise ConfigError("--ranks: every rank count must be at least 1")
    if daemons < 1:
        raise ConfigError("--daemons: must be at least 1")
    if any(n < daemons for n in ranks):
        raise ConfigError(f"--ranks: every rank count must be at least --daemons ({daemons}): "
                          "each daemon hosts at least one rank")
    if any(s < 2 or s % 2 for s in sizes):
        raise ConfigError("--sizes: every size must be a positive, even byte count (bf16)")
    if args.iters < 0:
        raise ConfigError("--iters: must not be negative")
    if any(n > 64 for n in ranks):  # (each rank is a process, twice over with gloo)
        raise ConfigError("--ranks: at most 64 ranks")
    _check_writable(args.json)  # before minutes of measuring, not after
    plan = Plan(sizes, tuple(args.iters or default_iters(s) for s in sizes),
                args.iters or default_iters(8))
    torch_version = None if args.no_gloo else _torch_version()
    if not args.no_gloo and torch_version is None:
        print("commd bench: torch is not importable; skipping the gloo side "
              "(install the 'bench' extra)", file=sys.stderr)
    cpus = sorted(os.sched_getaffinity(0))
    pinning = pinning_note(cpus, args.pin)
    machine = _machine(pinning, torch_version)  # before the run: the load average is others'
    rows: list[dict[str, Any]] = []
    try:
        for n in ranks:
            workers = worker_cpus(n, cpus, args.pin)
            print(f"{world_label(n, daemons)}: commd ...", file=sys.stderr, flush=True)
            commd = _bench_commd(n, daemons, workers, plan)
            gloo: dict[str, Stats] = {}
            if torch_version is not None:
                print(f"{n} ranks: gloo ...", file=sys.stderr, flush=True)
                gloo = run_side("gloo", [f"tcp://127.0.0.1:{free_port()}"] * n, workers, plan)
            for label, stats in commd.items():
                size = 0 if label == BARRIER else int(label)
                rows.append(_row(n, daemons, label, size, stats, gloo.get(label)))
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"commd bench: failed: {exc}", file=sys.stderr)
        return 1
    targets = check_targets(rows, daemons)
    print(render_table(rows, pinning, daemons))
    print()
    print("\n".join(["targets:", *(f"  {t['target']}: {t['verdict']}" for t in targets)]))
    report = {"machine": machine,
              "settings": {"ranks": ranks, "daemons": daemons, "sizes": sizes,
                           "iters": plan.iters, "barrier_iters": plan.barrier_iters,
                           "gloo": torch_version is not None,
                           "placement": "contiguous blocks; rank 0's daemon is the root",
                           "aggregation": "per iteration the slowest rank, then median/p99",
                           "checked": _CHECKED},
              "results": rows, "targets": targets}
    try:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"--json: cannot write {args.json}: {exc.strerror}") from None
    print(f"\nwrote {args.json}")
    return 0
