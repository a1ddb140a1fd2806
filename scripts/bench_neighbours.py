"""What other worlds on one daemon cost a world's small calls: a benchmark program.

One daemon (host engine). A "hot" world of 2 ranks times small all_reduces, once alone and
once beside each neighbour in turn:
  idle      --idle-worlds worlds of 2 ranks, connected, doing nothing (per-world timers)
  status    a process asking `status --world` of one of those, in a loop
  large     a world of 2 ranks running --large-bytes all_reduces back to back (the engine's
            shared threads)
Prints a table (latency per call: p50, p90, p99, mean, and p90 against the hot world's
alone), the daemon's CPU over --idle-seconds with no world and with the idle worlds (their
call timeout --idle-timeout: it sets how often a watched world would wake), and, with
--json, the same numbers. The machine's noise moves these by tens of
percent: compare runs made one after another, never with a fixed threshold.

    .venv/bin/python scripts/bench_neighbours.py [--calls 1000] [--idle-worlds 100]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from client import CommError, DaemonBackend, hostmem
from commd.launch import DaemonProcess, cpu_seconds
from commd.status import query_status

TIMEOUT_S = 60.0


def hot(sock: str, rank: int, nbytes: int, calls: int, out: Any) -> None:
    """The timed world's rank: a warm-up, then `calls` all_reduces; each one's seconds."""
    with DaemonBackend(sock, "hot", rank, 2, timeout=TIMEOUT_S) as comm:
        buf = hostmem.alloc(nbytes)
        for _ in range(50):
            comm.all_reduce(buf.ptr, nbytes, dtype="f32")
        took = []
        for _ in range(calls):
            started = time.perf_counter()
            comm.all_reduce(buf.ptr, nbytes, dtype="f32")
            took.append(time.perf_counter() - started)
        out.put(took)


def idle(sock: str, rank: int, worlds: int, timeout: float, ready: Any, stop: Event) -> None:
    comms = [DaemonBackend(sock, f"idle-{i}", rank, 2, timeout=timeout) for i in range(worlds)]
    try:
        for comm in comms:
            comm.barrier()
        ready.put(rank)
        stop.wait(600)
    finally:
        for comm in comms:
            comm.close()


def poll_status(sock: str, stop: Event) -> None:
    while not stop.is_set():
        query_status(sock, 10, "idle-0")


def large(sock: str, rank: int, nbytes: int, stop: Event) -> None:
    with DaemonBackend(sock, "large", rank, 2, timeout=TIMEOUT_S) as comm:
        buf, flag = hostmem.alloc(nbytes), hostmem.alloc(4)
        while True:
            comm.all_reduce(buf.ptr, nbytes, dtype="f32")
            # (both ranks must stop after the same call: rank 0 decides, and tells rank 1)
            flag.view("u4")[0] = int(stop.is_set())
            comm.broadcast(flag.ptr, 4, 0)
            if flag.view("u4")[0]:
                return


def timed(ctx: Any, sock: str, args: argparse.Namespace) -> list[float]:
    out = ctx.Queue()
    ranks = [ctx.Process(target=hot, args=(sock, r, args.bytes, args.calls, out)) for r in range(2)]
    for proc in ranks:
        proc.start()
    per_rank = [out.get(timeout=600) for _ in ranks]
    for proc in ranks:
        proc.join(30)
    return [max(pair) for pair in zip(*per_rank, strict=True)]  # a call ends with its slower rank


def daemon_cpu(pid: int, seconds: float) -> float:
    """The daemon's CPU over `seconds` of wall time, as a share of one core."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def summary(took: list[float], alone_p90: float | None) -> dict[str, float | None]:
    ordered = sorted(took)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e6

    return {"p50_us": at(0.5), "p90_us": at(0.9), "p99_us": at(0.99),
            "mean_us": statistics.fmean(took) * 1e6,
            "p90_vs_alone": None if alone_p90 is None else at(0.9) / alone_p90}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--bytes", type=int, default=1024, help="the hot world's all_reduce size")
    parser.add_argument("--idle-worlds", type=int, default=100)
    parser.add_argument("--idle-timeout", type=float, default=TIMEOUT_S,
                        help="the idle worlds' call timeout, seconds")
    parser.add_argument("--idle-seconds", type=float, default=5.0,
                        help="how long the daemon's idle CPU is measured")
    parser.add_argument("--large-bytes", type=int, default=64 << 20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows: dict[str, dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="commd-nb-") as tmp, \
            DaemonProcess(Path(tmp) / "commd.sock") as daemon:
        sock = str(daemon.socket_path)
        rows["alone"] = summary(timed(ctx, sock, args), None)
        alone_p90 = rows["alone"]["p90_us"]
        idle_cpu = {"no world": daemon_cpu(daemon.pid, args.idle_seconds)}
        stop, ready = ctx.Event(), ctx.Queue()
        holders = [ctx.Process(target=idle, args=(sock, r, args.idle_worlds, args.idle_timeout, ready, stop))
                   for r in range(2)]
        for proc in holders:
            proc.start()
        for _ in holders:
            ready.get(timeout=600)
        idle_cpu[f"{args.idle_worlds} idle worlds"] = daemon_cpu(daemon.pid, args.idle_seconds)
        rows[f"{args.idle_worlds} idle worlds"] = summary(timed(ctx, sock, args), alone_p90)
        def status_poller(quit: Event) -> list[Any]:
            return [ctx.Process(target=poll_status, args=(sock, quit))]

        def large_ops(quit: Event) -> list[Any]:
            return [ctx.Process(target=large, args=(sock, r, args.large_bytes, quit)) for r in range(2)]

        neighbours = {"status --world poller": status_poller,
                      f"{args.large_bytes >> 20} MiB all_reduces": large_ops}
        for name, make in neighbours.items():
            quit = ctx.Event()
            procs = make(quit)
            for proc in procs:
                proc.start()
            time.sleep(1.0)  # (under way)
            rows[f"{args.idle_worlds} idle + {name}"] = summary(timed(ctx, sock, args), alone_p90)
            quit.set()
            for proc in procs:
                proc.join(60)
        stop.set()
        for proc in holders:
            proc.join(60)
    print(f"hot world: 2 ranks, {args.bytes} B f32 all_reduce, {args.calls} calls; latency per call "
          "(the slower rank's), µs")
    print(f"{'beside':>44} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9} {'p90/alone':>10}")
    for name, row in rows.items():
        ratio = row["p90_vs_alone"]
        print(f"{name:>44} {row['p50_us']:9.1f} {row['p90_us']:9.1f} {row['p99_us']:9.1f} "
              f"{row['mean_us']:9.1f} {'-' if ratio is None else f'{ratio:.2f}':>10}")
    print(f"daemon CPU, % of one core, over {args.idle_seconds:g} s (idle worlds' timeout "
          f"{args.idle_timeout:g} s):")
    for name, share in idle_cpu.items():
        print(f"{name:>44} {share * 100:9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "idle_cpu": idle_cpu}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CommError as exc:
        print(f"bench_neighbours: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
