"""`commd demo`: a tensor-parallel decode loop through the daemon, every result checked.

Rank 0 sends each step's command with a 4-byte broadcast; the other ranks take
it with `recv_command_u32`. Each layer all_reduces a bf16 activation; each step
ends with an all_gather of the ranks' token ids. Every rank rebuilds all ranks'
inputs from a shared seed, so it can check every result against numpy, bit for
bit (the daemon accumulates in float32 in rank order and rounds once; so does
the reference).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import queue
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .errors import ConfigError

STOP = 0xFFFFFFFF
TOKENS = 64  # int32 token ids per rank per step


def activation(rank: int, step: int, layer: int, hidden: int) -> np.ndarray:
    """The bf16 activation rank `rank` contributes at (step, layer): the same on every rank."""
    rng = np.random.default_rng((rank, step, layer))
    return rng.uniform(-1.0, 1.0, hidden).astype(np.float32).astype(ml_dtypes.bfloat16)


def reference_sum(world_size: int, step: int, layer: int, hidden: int) -> np.ndarray:
    acc = np.zeros(hidden, np.float32)
    for rank in range(world_size):
        acc += activation(rank, step, layer, hidden).astype(np.float32)
    return acc.astype(ml_dtypes.bfloat16)


class WrongResult(Exception):
    """A call's result differs from numpy's (a check that `python -O` keeps, unlike assert)."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise WrongResult(what)


@dataclass
class Timings:
    samples: dict[str, list[float]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, seconds: float, nbytes: int) -> None:
        self.samples.setdefault(op, []).append(seconds)
        self.nbytes[op] = self.nbytes.get(op, 0) + nbytes


def _worker(sock: str, rank: int, world_size: int, steps: int, layers: int, hidden: int,
            timeout: float, out: Any) -> None:
    # Ctrl-C reaches every process of the terminal's job: the demo ends its workers itself,
    # where each one's KeyboardInterrupt printed a traceback that buried its "interrupted"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from client import CommError, DaemonBackend, hostmem

    timings = Timings()
    try:
        with DaemonBackend(sock, "demo", rank, world_size, timeout=timeout) as comm:
            _decode_loop(comm, hostmem, rank, world_size, steps, layers, hidden, timings, out)
        out.put(("done", rank, timings.samples, timings.nbytes))
    except (CommError, WrongResult) as exc:
        out.put(("error", rank, f"{type(exc).__name__}: {exc}", {}))


def _decode_loop(comm: Any, hostmem: Any, rank: int, world_size: int, steps: int, layers: int,
                 hidden: int, timings: Timings, out: Any) -> None:
    command = hostmem.alloc(4)
    act = hostmem.alloc(hidden * 2)
    tokens = hostmem.alloc(TOKENS * 4)
    gathered = hostmem.alloc(TOKENS * 4 * world_size)
    words, act_view = command.view(np.uint32), act.view(ml_dtypes.bfloat16)
    for step in range(steps + 1):
        t0 = time.perf_counter()
        if rank == 0:
            words[0] = step if step < steps else STOP
            comm.broadcast(command.ptr, 4, 0)
        else:
            comm.recv_command_u32(command.ptr, 0)
        timings.add("command", time.perf_counter() - t0, 4)
        if words[0] == STOP:
            break
        check(words[0] == step, f"rank {rank} got command {words[0]}, expected {step}")
        for layer in range(layers):
            act_view[:] = activation(rank, step, layer, hidden)
            t0 = time.perf_counter()
            comm.all_reduce(act.ptr, act.nbytes)
            timings.add("all_reduce", time.perf_counter() - t0, act.nbytes)
            expected = reference_sum(world_size, step, layer, hidden)
            check(np.array_equal(act_view.view(np.uint16), expected.view(np.uint16)),
                  f"rank {rank}: all_reduce at step {step} layer {layer} differs from numpy")
        tokens.view(np.int32)[:] = rank * 1_000_000 + step * 1000 + np.arange(TOKENS)
        t0 = time.perf_counter()
        comm.all_gather(tokens.ptr, gathered.ptr, tokens.nbytes)
        timings.add("all_gather", time.perf_counter() - t0, tokens.nbytes)
        want = np.concatenate([r * 1_000_000 + step * 1000 + np.arange(TOKENS)
                               for r in range(world_size)])
        check(np.array_equal(gathered.view(np.int32), want), f"rank {rank}: all_gather wrong at {step}")
        if rank == 0 and (step + 1) % max(1, steps // 10) == 0:
            out.put(("progress", rank, step + 1, {}))
    comm.barrier()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: dict[int, tuple[dict[str, list[float]], dict[str, int]]],
              steps: int, wall: float) -> str:
    ops = sorted({op for samples, _ in results.values() for op in samples})
    total_calls = sum(len(v) for samples, _ in results.values() for v in samples.values())
    lines = [
        f"steps {steps}   ranks {len(results)}   wall {wall:.2f}s   "
        f"calls {total_calls}   ops/s {total_calls / wall:,.0f} (all ranks)",
        f"{'op':<12} {'calls':>8} {'p50 µs':>10} {'p99 µs':>10} {'GB/s':>8}",
    ]
    for op in ops:
        samples = [s for res, _ in results.values() for s in res.get(op, [])]
        nbytes = sum(nb.get(op, 0) for _, nb in results.values())
        rate = nbytes / sum(samples) / 1e9 if samples and sum(samples) else 0.0
        lines.append(f"{op:<12} {len(samples):>8} {_percentile(samples, 0.5) * 1e6:>10.1f} "
                     f"{_percentile(samples, 0.99) * 1e6:>10.1f} {rate:>8.3f}")
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    from .launch import DaemonProcess

    n, steps = args.ranks, args.steps
    for name, ok, need in (("--ranks", 1 <= n <= 64, "1..64"), ("--steps", steps >= 1, "at least 1"),
                           ("--layers", args.layers >= 1, "at least 1"),
                           ("--hidden", args.hidden >= 1, "at least 1")):
        if not ok:
            raise ConfigError(f"{name}: must be {need}")
    with tempfile.TemporaryDirectory(prefix="commd-demo-") as tmp:
        sock = str(Path(tmp) / "run" / "commd.sock")
        print(f"starting commd (host engine) at {sock}")
        with _terminated_as_exit(), DaemonProcess(sock) as daemon:
            print(f"daemon pid {daemon.pid}; starting {n} workers: {steps} steps x "
                  f"{args.layers} layers, bf16 activations of {args.hidden} elements")
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            workers = [ctx.Process(target=_worker, args=(sock, r, n, steps, args.layers, args.hidden,
                                                         args.timeout, out)) for r in range(n)]
            try:
                start = time.perf_counter()
                for w in workers:
                    w.start()
                results, errors = _collect(out, workers, steps, args.timeout)
                wall = time.perf_counter() - start
                for w in workers:
                    w.join(args.timeout)
            finally:  # (also interrupted, or stopped: the workers would run on without us)
                for w in workers:
                    if w.is_alive():
                        w.kill()
                        w.join(5)
            code = daemon.stop()
        if errors:
            print("FAILED:\n  " + "\n  ".join(errors))
            return 1
        print(summarize(results, steps, wall))
        print(f"every result matched numpy; daemon exited with code {code}")
        return 0 if code == 0 else 1


@contextlib.contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """SIGTERM (`kill`, `timeout`) ends the demo as an exception does, so that its workers
    and its daemon are stopped on the way out: by default it ended the demo alone, and they
    ran on, orphaned."""
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _collect(out: Any, workers: list[Any], steps: int, timeout: float
             ) -> tuple[dict[int, tuple[dict[str, list[float]], dict[str, int]]], list[str]]:
    results: dict[int, tuple[dict[str, list[float]], dict[str, int]]] = {}
    errors: list[str] = []
    last_word = time.monotonic()
    heard: set[int] = set()
    while len(results) + len(errors) < len(workers):
        try:
            kind, rank, payload, extra = out.get(timeout=0.5)
        except queue.Empty:
            # a worker that died of something else than a CommError says nothing: its
            # exit code does (the others would wait for it until their timeout)
            dead = [f"rank {r}: its process ended with exit code {w.exitcode}, saying nothing "
                    f"(its traceback is above)" for r, w in enumerate(workers)
                    if w.exitcode not in (None, 0) and r not in heard]
            if dead:
                errors.extend(dead)
                break
            if time.monotonic() - last_word > timeout:
                errors.append(f"no word from the workers for {timeout}s")
                break
            continue
        last_word = time.monotonic()
        if kind == "progress":
            print(f"  step {payload}/{steps}", flush=True)
            continue
        heard.add(rank)
        if kind == "done":
            results[rank] = (payload, extra)
        else:
            errors.append(f"rank {rank}: {payload}")
    return results, errors
