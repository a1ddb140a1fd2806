"""`commd bench`: DaemonBackend all_reduce and barrier against torch.distributed gloo.

For each rank count the bench starts one daemon and n commd workers, then n gloo
workers (spawned processes), and every rank times each call with perf_counter.
A row's latency per iteration is the slowest rank's time for that iteration (a
collective is done only when every rank has its result); the table shows the
median and p99 of that over the iterations. Throughput is algorithm bandwidth:
bytes / median seconds. Ratios are gloo / commd, so above 1 means commd is faster.

Buffers hold random bf16 values in [2^-7, 2^-2); they are refilled from a pristine
copy, outside the timed call, before repeated sums could reach inf.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import multiprocessing.queues as mpq
import os
import platform
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError
from .launch import DaemonProcess

BARRIER = "barrier"
_CALL_TIMEOUT_S = 120.0  # one call; generous because the 2-core VM is shared
_SIDE_TIMEOUT_S = 600.0  # one side's whole run for one rank count
_REAP_TIMEOUT_S = 10.0
# (ranks, bytes, how many times better than gloo, measured as): the project's goals.
_TARGETS = ((2, 8, 4.0, "latency"), (4, 8, 4.0, "latency"), (4, 64 << 20, 2.0, "bandwidth"))

Timings = dict[str, list[float]]  # row label -> seconds per iteration
CpuSet = tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class _Job:
    """What one worker process runs; pickled to the spawned child."""

    side: str  # "commd" or "gloo"
    rank: int
    world_size: int
    address: str  # the daemon's socket path, or gloo's tcp:// init method
    sizes: tuple[int, ...]
    iters: tuple[int, ...]
    barrier_iters: int
    cpus: CpuSet


@dataclass(frozen=True, slots=True)
class Stats:
    iters: int
    median_us: float
    p99_us: float
    mean_us: float
    min_us: float


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


# ---- worker side ---------------------------------------------------------------------


def _random_bf16_bits(size: int, seed: int) -> np.ndarray:
    # Built from bits, not floats: sign, exponent 120..123 (magnitude [2^-7, 2^-2))
    # and a random mantissa, so no NaN, inf or subnormal ever enters the timing.
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size // 2, dtype=np.uint16)
    return (bits & np.uint16(0x81FF)) | np.uint16(0x3C00)


def _refill_every(world_size: int) -> int:
    # A sum over n ranks grows by at most n per call; refill before it passes 2^100.
    return max(1, 100 // world_size.bit_length())


def _measure(call: Callable[[], object], refill: Callable[[], object],
             barrier: Callable[[], object], iters: int, refill_every: int) -> list[float]:
    clock = time.perf_counter
    for i in range(max(3, iters // 10)):  # warm-up: first-touch, imports, the daemon's import
        if i % refill_every == 0:
            refill()
        call()
    barrier()  # every rank starts the timed loop together
    times: list[float] = []
    for i in range(iters):
        if i % refill_every == 0:
            refill()
        start = clock()
        call()
        times.append(clock() - start)
    return times


def _nothing() -> None:
    pass


def _commd_size(comm: Any, job: _Job, size: int, iters: int) -> list[float]:
    from client import hostmem

    buf = hostmem.alloc(size)
    times = _commd_timed(comm, buf, job, size, iters)
    buf.close()  # after _commd_timed returned: close refuses while its view is alive
    return times


def _commd_timed(comm: Any, buf: Any, job: _Job, size: int, iters: int) -> list[float]:
    data, pristine, ptr = buf.view(np.uint16), _random_bf16_bits(size, job.rank), buf.ptr
    return _measure(lambda: comm.all_reduce(ptr, size), lambda: np.copyto(data, pristine),
                    comm.barrier, iters, _refill_every(job.world_size))


def _run_commd(job: _Job) -> Timings:
    from client import DaemonBackend

    out: Timings = {}
    with DaemonBackend(job.address, "bench", job.rank, job.world_size,
                       timeout=_CALL_TIMEOUT_S) as comm:
        for size, iters in zip(job.sizes, job.iters, strict=True):
            out[str(size)] = _commd_size(comm, job, size, iters)
        out[BARRIER] = _measure(comm.barrier, _nothing, comm.barrier, job.barrier_iters, 1)
    return out


def _gloo_size(dist: Any, torch: Any, job: _Job, size: int, iters: int) -> list[float]:
    pristine = torch.from_numpy(_random_bf16_bits(size, job.rank)).view(torch.bfloat16)
    tensor = pristine.clone()
    return _measure(lambda: dist.all_reduce(tensor), lambda: tensor.copy_(pristine),
                    dist.barrier, iters, _refill_every(job.world_size))


def _run_gloo(job: _Job) -> Timings:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one rank per core, as the commd workers
    dist.init_process_group("gloo", init_method=job.address, rank=job.rank,
                            world_size=job.world_size,
                            timeout=datetime.timedelta(seconds=_CALL_TIMEOUT_S))
    try:
        out: Timings = {}
        for size, iters in zip(job.sizes, job.iters, strict=True):
            out[str(size)] = _gloo_size(dist, torch, job, size, iters)
        out[BARRIER] = _measure(dist.barrier, _nothing, dist.barrier, job.barrier_iters, 1)
        return out
    finally:
        dist.destroy_process_group()


def _worker(job: _Job, results: mpq.Queue[Any]) -> None:
    try:
        if job.cpus is not None:
            os.sched_setaffinity(0, job.cpus)
        timings = _run_commd(job) if job.side == "commd" else _run_gloo(job)
        results.put(("ok", job.rank, timings))
    except BaseException:
        results.put(("error", job.rank, traceback.format_exc()))


# ---- parent side -----------------------------------------------------------------------


def _collect(results: mpq.Queue[Any], procs: Sequence[mp.process.BaseProcess],
             deadline: float) -> dict[int, Timings]:
    got: dict[int, Timings] = {}
    dead_since: float | None = None
    while len(got) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {sorted(set(range(len(procs))) - set(got))} "
                               "did not report in time")
        try:
            status, rank, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            # A rank may exit just after putting its result: give the pipe a moment.
            if dead and dead_since is None:
                dead_since = time.monotonic()
            elif dead and dead_since is not None and time.monotonic() - dead_since > 3.0:
                codes = {r: procs[r].exitcode for r in dead}
                raise RuntimeError(f"worker ranks exited without a result: {codes}") from None
            continue
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        got[rank] = payload
    return got


def _reap(procs: Sequence[mp.process.BaseProcess]) -> None:
    procs = [p for p in procs if p.pid is not None]  # a failed start leaves some unstarted
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _run_side(side: str, address: str, n: int, workers: list[CpuSet], sizes: tuple[int, ...],
              iters: tuple[int, ...], barrier_iters: int) -> dict[str, Stats]:
    ctx = mp.get_context("spawn")
    results: mpq.Queue[Any] = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"bench-{side}-{rank}", daemon=True,
                         args=(_Job(side, rank, n, address, sizes, iters, barrier_iters,
                                    workers[rank]), results))
             for rank in range(n)]
    try:
        for proc in procs:
            proc.start()
        got = _collect(results, procs, time.monotonic() + _SIDE_TIMEOUT_S)
    finally:
        _reap(procs)
        results.close()
    return {label: _stats(np.max([got[r][label] for r in range(n)], axis=0))
            for label in got[0]}


def _stats(seconds: np.ndarray) -> Stats:
    us = seconds * 1e6
    return Stats(len(us), float(np.median(us)), float(np.percentile(us, 99)),
                 float(np.mean(us)), float(np.min(us)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bench_commd(n: int, workers: list[CpuSet], sizes: tuple[int, ...],
                 iters: tuple[int, ...], barrier_iters: int) -> dict[str, Stats]:
    with tempfile.TemporaryDirectory(prefix="commd-bench-") as tmp:
        sock = Path(tmp) / "commd.sock"
        with DaemonProcess(sock):
            return _run_side("commd", str(sock), n, workers, sizes, iters, barrier_iters)


# ---- report ----------------------------------------------------------------------------


def _row(n: int, label: str, size: int, commd: Stats, gloo: Stats | None) -> dict[str, Any]:
    def side(s: Stats) -> dict[str, Any]:
        return {**dataclasses.asdict(s), "gbps": size / s.median_us / 1e3 if size else None}

    ratio = gloo.median_us / commd.median_us if gloo is not None else None
    return {"ranks": n, "op": "barrier" if label == BARRIER else "all_reduce", "bytes": size,
            "label": "barrier" if label == BARRIER else size_label(size),
            "commd": side(commd), "gloo": None if gloo is None else side(gloo),
            # Same bytes on both sides, so the bandwidth ratio is the latency ratio.
            "latency_ratio": ratio, "throughput_ratio": ratio if size else None}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(rows: Sequence[dict[str, Any]], pinning: str) -> str:
    head = ["commd DaemonBackend vs torch.distributed gloo: all_reduce (bf16, sum) and barrier",
            f"pinning: {pinning}",
            "latency: per iteration the slowest rank's time; median and p99 over the iterations",
            "lat ratio: gloo median / commd median (>1: commd faster; equals the GB/s ratio)"]
    cols = ("ranks", "op/size", "commd med µs", "commd p99 µs", "gloo med µs", "gloo p99 µs",
            "lat ratio", "commd GB/s", "gloo GB/s")
    lines = [*head, "  ".join(f"{c:>12}" for c in cols)]
    for r in rows:
        c, g = r["commd"], r["gloo"] or {}
        cells = (str(r["ranks"]), r["label"], _fmt(c["median_us"], ".1f"), _fmt(c["p99_us"], ".1f"),
                 _fmt(g.get("median_us"), ".1f"), _fmt(g.get("p99_us"), ".1f"),
                 _fmt(r["latency_ratio"], ".2f"), _fmt(c["gbps"], ".3g"), _fmt(g.get("gbps"), ".3g"))
        lines.append("  ".join(f"{cell:>12}" for cell in cells))
    return "\n".join(lines)


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The project's goals for this bench, each with a one-line verdict."""
    out = []
    for n, size, goal, what in _TARGETS:
        row = next((r for r in rows if (r["ranks"], r["op"], r["bytes"]) == (n, "all_reduce", size)),
                   None)
        ratio = row["latency_ratio"] if row is not None else None
        name = f"{size_label(size)} all_reduce, {n} ranks: {what} >= {goal:g}x gloo's"
        if row is None or ratio is None:
            verdict = "not measured" if row is None else "no gloo numbers"
        else:
            c, g = row["commd"], row["gloo"]
            detail = (f"commd {c['gbps']:.3f} GB/s vs gloo {g['gbps']:.3f} GB/s" if what == "bandwidth"
                      else f"commd {c['median_us']:.1f} µs vs gloo {g['median_us']:.1f} µs")
            verdict = f"{detail} = {ratio:.2f}x: {'met' if ratio >= goal else 'NOT met'}"
        out.append({"target": name, "goal": goal, "ratio": ratio,
                    "met": None if ratio is None else ratio >= goal, "verdict": verdict})
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


def run_bench(args: argparse.Namespace) -> int:
    ranks = _parse_ints(args.ranks, "--ranks")
    sizes = _parse_ints(args.sizes, "--sizes")
    if any(n < 1 for n in ranks):
        raise ConfigError("--ranks: every rank count must be at least 1")
    if any(s < 2 or s % 2 for s in sizes):
        raise ConfigError("--sizes: every size must be a positive, even byte count (bf16)")
    if args.iters < 0:
        raise ConfigError("--iters: must not be negative")
    iters = tuple(args.iters or default_iters(s) for s in sizes)
    barrier_iters = args.iters or default_iters(8)
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
            print(f"ranks={n}: commd ...", file=sys.stderr, flush=True)
            commd = _bench_commd(n, workers, sizes, iters, barrier_iters)
            gloo: dict[str, Stats] = {}
            if torch_version is not None:
                print(f"ranks={n}: gloo ...", file=sys.stderr, flush=True)
                gloo = _run_side("gloo", f"tcp://127.0.0.1:{_free_port()}", n, workers, sizes,
                                 iters, barrier_iters)
            for label, stats in commd.items():
                size = 0 if label == BARRIER else int(label)
                rows.append(_row(n, label, size, stats, gloo.get(label)))
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"commd bench: failed: {exc}", file=sys.stderr)
        return 1
    targets = check_targets(rows)
    print(render_table(rows, pinning))
    print()
    print("\n".join(["targets:", *(f"  {t['target']}: {t['verdict']}" for t in targets)]))
    report = {"machine": machine,
              "settings": {"ranks": ranks, "sizes": sizes, "iters": iters,
                           "barrier_iters": barrier_iters, "gloo": torch_version is not None,
                           "aggregation": "per iteration the slowest rank, then median/p99"},
              "results": rows, "targets": targets}
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0
