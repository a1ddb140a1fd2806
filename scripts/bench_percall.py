"""Where a small call's time goes: a benchmark program.

One daemon (host engine), --ranks workers (rank r pinned to CPU r % CPUs), each making
--iters all_reduces of --bytes back to back after a warm-up. Prints, and with --json
writes: the median latency (the slowest rank's median), the daemon's CPU per call and each
worker's CPU per call (utime + stime from /proc, and process_time). The CPU columns move
less with the machine's load than latency does; still compare code against code only in
runs made alternately (two checkouts: run this from inside each, with PYTHONPATH=$PWD).

    .venv/bin/python scripts/bench_percall.py [--ranks 4] [--iters 2000] [--bytes 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from client import CommError, DaemonBackend, hostmem
from commd.launch import DaemonProcess, cpu_seconds

WARMUP = 300


def worker(sock: str, rank: int, ranks: int, nbytes: int, iters: int, daemon_pid: int, out: Any) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    with DaemonBackend(sock, "percall", rank, ranks, timeout=60) as comm:
        buf = hostmem.alloc(max(nbytes, 1))
        for _ in range(WARMUP):
            comm.all_reduce(buf.ptr, nbytes, dtype="u8")
        comm.barrier()  # every rank starts together
        daemon_before, mine_before = cpu_seconds(daemon_pid), time.process_time()
        took = []
        for _ in range(iters):
            started = time.perf_counter()
            comm.all_reduce(buf.ptr, nbytes, dtype="u8")
            took.append(time.perf_counter() - started)
        daemon_after, mine_after = cpu_seconds(daemon_pid), time.process_time()
        comm.barrier()
    out.put({"rank": rank, "median_us": statistics.median(took) * 1e6,
             "daemon_cpu_us": (daemon_after - daemon_before) / iters * 1e6,
             "worker_cpu_us": (mine_after - mine_before) / iters * 1e6})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="commd-pc-") as tmp, \
            DaemonProcess(Path(tmp) / "commd.sock") as daemon:
        out = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(str(daemon.socket_path), r, args.ranks, args.bytes,
                                                   args.iters, daemon.pid, out))
                 for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        rows = sorted((out.get(timeout=600) for _ in procs), key=lambda row: row["rank"])
        for proc in procs:
            proc.join(60)
    # (every rank read the daemon's CPU over about the same span: rank 0's stands for it)
    result = {"ranks": args.ranks, "bytes": args.bytes, "iters": args.iters,
              "median_us": max(row["median_us"] for row in rows),
              "daemon_cpu_us": rows[0]["daemon_cpu_us"],
              "worker_cpu_us": statistics.fmean(row["worker_cpu_us"] for row in rows),
              "per_rank": rows}
    print(f"{args.ranks} ranks, {args.bytes} B u8 all_reduce, {args.iters} calls after {WARMUP}: "
          f"median {result['median_us']:.1f} µs; CPU per call: daemon {result['daemon_cpu_us']:.1f} µs, "
          f"each worker {result['worker_cpu_us']:.1f} µs")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CommError as exc:
        print(f"bench_percall: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
