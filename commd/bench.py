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
_SIDE_TIMEOUT_S = 900.0  # one side's whole run for one rank count
_REAP_TIMEOUT_S = 10.0
_TARGET_LATENCY = 4.0  # 8 B all_reduce: commd this many times faster than gloo
_TARGET_THROUGHPUT = 2.0  # 64 MiB, 4 ranks: this many times gloo's bandwidth

Timings = dict[str, list[float]]  # row label -> seconds per iteration
CpuSet = tuple[int, ...] | None
Plan = tuple[CpuSet, list[CpuSet]]  # the daemon's CPUs, each worker rank's


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
    """Iterations for one size when --iters is 0: enough for a stable p99 on small calls."""
    if size <= 4096:
        return 2000
    if size <= 64 << 10:
        return 500
    if size <= 1 << 20:
        return 100
    if size <= 16 << 20:
        return 20
    return 10


def size_label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def pin_plan(n: int, cpus: Sequence[int]) -> Plan:
    """CPUs for the daemon and for each worker rank; (None, [None]*n) when not pinning.

    The daemon keeps every CPU: its reduction threads need all cores for large
    messages, and pinning it to one core cost more at 64 MiB than it saved at 8 B.
    Workers go round-robin, one per core, the same for commd and gloo; that stops
    the scheduler from migrating a rank in the middle of a call (a cold cache and a
    cross-CPU wake-up each time) without favouring either side.
    """
    if len(cpus) < 2:
        return None, [None] * n
    return None, [(cpus[rank % len(cpus)],) for rank in range(n)]


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


def _bench_commd(n: int, plan: Plan, sizes: tuple[int, ...],
                 iters: tuple[int, ...], barrier_iters: int) -> dict[str, Stats]:
    daemon_cpus, workers = plan
    with tempfile.TemporaryDirectory(prefix="commd-bench-") as tmp:
        sock = Path(tmp) / "commd.sock"
        with DaemonProcess(sock, cpus=list(daemon_cpus) if daemon_cpus else None):
            return _run_side("commd", str(sock), n, workers, sizes, iters, barrier_iters)


def _bench_gloo(n: int, plan: Plan, sizes: tuple[int, ...],
                iters: tuple[int, ...], barrier_iters: int) -> dict[str, Stats]:
    address = f"tcp://127.0.0.1:{_free_port()}"
    return _run_side("gloo", address, n, plan[1], sizes, iters, barrier_iters)


# ---- report ----------------------------------------------------------------------------


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _row(n: int, label: str, size: int, commd: Stats, gloo: Stats | None) -> dict[str, Any]:
    def gbps(s: Stats | None) -> float | None:
        return size / s.median_us / 1e3 if s is not None and size else None

    return {
        "ranks": n, "op": "barrier" if label == BARRIER else "all_reduce", "bytes": size,
        "label": "barrier" if label == BARRIER else size_label(size),
        "commd": {**_asdict(commd), "gbps": gbps(commd)},
        "gloo": None if gloo is None else {**_asdict(gloo), "gbps": gbps(gloo)},
        "latency_ratio": _ratio(gloo.median_us if gloo else None, commd.median_us),
        "throughput_ratio": _ratio(gbps(commd), gbps(gloo)),
    }


def _asdict(stats: Stats) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in Stats.__slots__}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(rows: Sequence[dict[str, Any]], pinned: bool) -> str:
    head = (f"commd vs gloo, bf16 sum all_reduce and barrier; latency per iteration = slowest "
            f"rank's, then median/p99 over iterations; pinning {'on' if pinned else 'off'}; "
            "ratio = gloo/commd (>1: commd faster)")
    cols = ("ranks", "op/size", "commd med µs", "commd p99 µs", "gloo med µs", "gloo p99 µs",
            "lat ratio", "commd GB/s", "gloo GB/s")
    lines = [head, "  ".join(f"{c:>12}" for c in cols)]
    for r in rows:
        c, g = r["commd"], r["gloo"] or {}
        cells = (str(r["ranks"]), r["label"], _fmt(c["median_us"], ".1f"), _fmt(c["p99_us"], ".1f"),
                 _fmt(g.get("median_us"), ".1f"), _fmt(g.get("p99_us"), ".1f"),
                 _fmt(r["latency_ratio"], ".2f"), _fmt(c["gbps"], ".3f"), _fmt(g.get("gbps"), ".3f"))
        lines.append("  ".join(f"{cell:>12}" for cell in cells))
    return "\n".join(lines)


def _targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    def find(n: int, size: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["ranks"] == n and r["op"] == "all_reduce"
                     and r["bytes"] == size), None)

    wanted = [(f"8 B all_reduce, {n} ranks: latency", n, 8, "latency_ratio", _TARGET_LATENCY)
              for n in (2, 4)]
    wanted.append(("64 MiB all_reduce, 4 ranks: throughput", 4, 64 << 20, "throughput_ratio",
                   _TARGET_THROUGHPUT))
    out = []
    for name, n, size, key, goal in wanted:
        row = find(n, size)
        ratio = row[key] if row else None
        out.append({"target": name, "goal": goal, "ratio": ratio,
                    "met": None if ratio is None else ratio >= goal, "row": row})
    return out


def render_targets(targets: Sequence[dict[str, Any]]) -> str:
    lines = ["targets:"]
    for t in targets:
        row = t["row"]
        if row is None:
            lines.append(f"  {t['target']} >= {t['goal']:g}x gloo: not measured")
            continue
        if t["ratio"] is None:
            lines.append(f"  {t['target']} >= {t['goal']:g}x gloo: no gloo numbers")
            continue
        c, g = row["commd"], row["gloo"]
        detail = (f"commd {c['gbps']:.3f} GB/s vs gloo {g['gbps']:.3f} GB/s"
                  if "throughput" in t["target"] else
                  f"commd {c['median_us']:.1f} µs vs gloo {g['median_us']:.1f} µs")
        verdict = "met" if t["met"] else "NOT met"
        lines.append(f"  {t['target']} >= {t['goal']:g}x gloo: {detail} = {t['ratio']:.2f}x: {verdict}")
    return "\n".join(lines)


def _machine(pinned: bool, torch_version: str | None) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "machine": platform.machine(), "platform": platform.platform(),
        "python": sys.version.split()[0], "numpy": np.__version__, "torch": torch_version,
        "pinning": pinned, "load_average": list(os.getloadavg()),
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
    rows: list[dict[str, Any]] = []
    pinned = False
    try:
        for n in ranks:
            plan: Plan = pin_plan(n, cpus) if args.pin else (None, [None] * n)
            pinned = pinned or any(c is not None for c in plan[1]) or plan[0] is not None
            print(f"ranks={n}: commd ...", file=sys.stderr, flush=True)
            commd = _bench_commd(n, plan, sizes, iters, barrier_iters)
            gloo: dict[str, Stats] = {}
            if torch_version is not None:
                print(f"ranks={n}: gloo ...", file=sys.stderr, flush=True)
                gloo = _bench_gloo(n, plan, sizes, iters, barrier_iters)
            for label, stats in commd.items():
                size = 0 if label == BARRIER else int(label)
                rows.append(_row(n, label, size, stats, gloo.get(label)))
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"commd bench: failed: {exc}", file=sys.stderr)
        return 1
    targets = _targets(rows)
    print(render_table(rows, pinned))
    print()
    print(render_targets(targets))
    report = {"machine": _machine(pinned, torch_version),
              "settings": {"ranks": ranks, "sizes": sizes, "iters": iters,
                           "barrier_iters": barrier_iters, "gloo": torch_version is not None,
                           "aggregation": "per iteration the slowest rank, then median/p99"},
              "results": rows, "targets": [{k: v for k, v in t.items() if k != "row"}
                                           for t in targets]}
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0
