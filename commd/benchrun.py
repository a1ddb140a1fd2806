"""`commd bench`'s worker processes: what each rank times, and running one side's ranks.

Each rank runs in a spawned process; the parent collects every rank's per-iteration
times from a queue, with a deadline, and reaps the processes whatever happens.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import multiprocessing.queues as mpq
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.errors import CommError

BARRIER = "barrier"
CALL_TIMEOUT_S = 120.0  # one call (and the join); generous because the 2-core VM is shared
_SIDE_TIMEOUT_S = 600.0  # one side's whole run for one rank count
_REAP_TIMEOUT_S = 10.0

Timings = dict[str, list[float]]  # row label -> seconds per iteration
CpuSet = tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Plan:
    """What every rank of one side measures."""

    sizes: tuple[int, ...]
    iters: tuple[int, ...]
    barrier_iters: int


@dataclass(frozen=True, slots=True)
class _Job:
    """What one worker process runs; pickled to the spawned child."""

    side: str  # "commd" or "gloo"
    rank: int
    world_size: int
    address: str  # its daemon's socket path, or gloo's tcp:// init method
    bootstrap: str | None  # commd over several daemons: the root daemon's peer address
    plan: Plan
    cpus: CpuSet


@dataclass(frozen=True, slots=True)
class Stats:
    iters: int
    median_us: float
    p99_us: float
    mean_us: float
    min_us: float


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
             barrier: Callable[[], object], iters: int, refill_every: int,
             check: Callable[[], object]) -> list[float]:
    clock = time.perf_counter
    for i in range(max(3, iters // 10)):  # warm-up: first-touch, imports, the daemon's import
        if i % refill_every == 0:
            refill()
        call()
        if i == 0:  # (the first result, from the pristine inputs: a fast wrong answer is no result)
            check()
    barrier()  # every rank starts the timed loop together
    times: list[float] = []
    for i in range(iters):
        if i % refill_every == 0:
            refill()
        start = clock()
        call()
        times.append(clock() - start)
    return times


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns as float32, exactly (a bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def check_sum(side: str, got: np.ndarray, size: int, world_size: int) -> None:
    """RuntimeError unless `got` (bf16 bits) is the sum of every rank's pristine input, each
    element within n bf16 roundings of the exact sum (n = ranks: a ring rounds each step,
    commd once), relative to the sum of the magnitudes. Leaving out any rank's input misses
    by at least 2^-7 against a bound below 2^-8 at 2 ranks. Summed in float32 one rank at a
    time (its error is 2^-16 of the bound): a 64 MiB check holds two arrays, not one per rank."""
    exact = np.zeros(size // 2, np.float32)
    scale = np.zeros_like(exact)
    for rank in range(world_size):
        values = bf16_values(_random_bf16_bits(size, rank))
        exact += values
        scale += np.abs(values)
    values = bf16_values(got)
    bad = np.flatnonzero(~(np.abs(values - exact) <= world_size * 2.0 ** -8 * scale))
    if bad.size:
        i = int(bad[0])
        raise RuntimeError(f"{side}: the {size}-byte bf16 all_reduce summed {bad.size} of "
                           f"{len(exact)} elements wrong (element {i}: {float(values[i])!r}, "
                           f"the exact sum {float(exact[i])!r})")


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
                    comm.barrier, iters, _refill_every(job.world_size),
                    lambda: check_sum("commd", data, size, job.world_size))


def _run_commd(job: _Job) -> Timings:
    from client import DaemonBackend

    out: Timings = {}
    plan = job.plan
    with DaemonBackend(job.address, "bench", job.rank, job.world_size,
                       bootstrap=job.bootstrap, timeout=CALL_TIMEOUT_S) as comm:
        for size, iters in zip(plan.sizes, plan.iters, strict=True):
            out[str(size)] = _commd_size(comm, job, size, iters)
        out[BARRIER] = _measure(comm.barrier, _nothing, comm.barrier, plan.barrier_iters, 1, _nothing)
    return out


def _gloo_size(dist: Any, torch: Any, job: _Job, size: int, iters: int) -> list[float]:
    pristine = torch.from_numpy(_random_bf16_bits(size, job.rank)).view(torch.bfloat16)
    tensor = pristine.clone()
    return _measure(lambda: dist.all_reduce(tensor), lambda: tensor.copy_(pristine),
                    dist.barrier, iters, _refill_every(job.world_size),
                    lambda: check_sum("gloo", tensor.view(torch.int16).numpy().view(np.uint16),
                                      size, job.world_size))


def _run_gloo(job: _Job) -> Timings:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one rank per core, as the commd workers
    dist.init_process_group("gloo", init_method=job.address, rank=job.rank,
                            world_size=job.world_size,
                            timeout=datetime.timedelta(seconds=CALL_TIMEOUT_S))
    try:
        out: Timings = {}
        plan = job.plan
        for size, iters in zip(plan.sizes, plan.iters, strict=True):
            out[str(size)] = _gloo_size(dist, torch, job, size, iters)
        out[BARRIER] = _measure(dist.barrier, _nothing, dist.barrier, plan.barrier_iters, 1, _nothing)
        return out
    finally:
        dist.destroy_process_group()


def _worker(job: _Job, results: mpq.Queue[Any]) -> None:
    try:
        if job.cpus is not None:
            os.sched_setaffinity(0, job.cpus)
        timings = _run_commd(job) if job.side == "commd" else _run_gloo(job)
        results.put(("ok", job.rank, timings))
    except CommError as exc:  # (typed: its words say what happened, a traceback only buries them)
        results.put(("error", job.rank, f"{type(exc).__name__}: {exc}"))
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


@contextlib.contextmanager
def ctrl_c_after(saying: str) -> Iterator[None]:
    """Ctrl-C held off until the block ends, then raised (once, however often it came);
    at the first, "commd bench: `saying`" goes to stderr.

    Around the ends of what the bench started, each bounded: a second Ctrl-C there broke
    off the loop and left what came after the one it was waiting on running (a daemon
    serving, or a worker SIGSTOPped that multiprocessing's exit then waited on for ever),
    and that one without its SIGKILL if it hung. Only the main thread can take signals:
    elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        if not came:
            print(f"commd bench: {saying}", file=sys.stderr)
        came.append(signum)

    before = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if came:
        raise KeyboardInterrupt


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


def run_side(side: str, addresses: Sequence[str], workers: Sequence[CpuSet], plan: Plan,
             bootstrap: str | None = None) -> dict[str, Stats]:
    """Run one side's ranks (rank r at addresses[r], on CPUs workers[r]); per row, the stats
    of the slowest rank's time per iteration."""
    n = len(addresses)
    ctx = mp.get_context("spawn")
    results: mpq.Queue[Any] = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"bench-{side}-{rank}", daemon=True,
                         args=(_Job(side, rank, n, addresses[rank], bootstrap, plan,
                                    workers[rank]), results))
             for rank in range(n)]
    try:
        for proc in procs:
            proc.start()
        got = _collect(results, procs, time.monotonic() + _SIDE_TIMEOUT_S)
    finally:
        with ctrl_c_after("ending the worker ranks first"):
            _reap(procs)
        results.close()
    return {label: _stats(np.max([got[r][label] for r in range(n)], axis=0))
            for label in got[0]}


def _stats(seconds: np.ndarray) -> Stats:
    us = seconds * 1e6
    return Stats(len(us), float(np.median(us)), float(np.percentile(us, 99)),
                 float(np.mean(us)), float(np.min(us)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
