"""One rank of a gpu_check world: `worker.py ROLE '<json args>'`.

Roles: calls, ordering, victim, survivor, replacement, bench, torchbench. Every role
prints `@@RESULT <json>` last (procs.py reads it). Data is made with torch on the CPU,
seeded by (seed, rank), so any rank can regenerate every rank's input and compute the
reference itself. `mem` is "cuda" (torch CUDA tensors, raw `data_ptr()`s) or "host"
(client.hostmem buffers, for a dry run on the host engine).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "u8": torch.uint8}


def emit(kind: str, name: str = "", payload: Any = None) -> None:
    if kind == "RESULT":
        print("@@RESULT " + json.dumps(payload), flush=True)
    else:
        print(f"@@EVENT {name} " + json.dumps(payload), flush=True)


# ---- memory: the same calls on CUDA tensors or host buffers ---------------------------------

class Buf:
    """`nbytes` of worker memory at `ptr`; write/read go through CPU tensors."""

    ptr: int
    nbytes: int

    def write(self, src: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, dtype: str = "u8") -> torch.Tensor:
        raise NotImplementedError


class CudaBuf(Buf):
    def __init__(self, nbytes: int, tensor: torch.Tensor | None = None) -> None:
        self.nbytes = nbytes
        self.t = tensor if tensor is not None else torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                                               device="cuda")
        self.ptr = self.t.data_ptr()

    def write(self, src: torch.Tensor) -> None:
        raw = src.contiguous().view(-1).view(torch.uint8)
        self.t[: raw.numel()].copy_(raw)
        torch.cuda.synchronize()  # the calls check data, not ordering (step 5 does that)

    def read(self, dtype: str = "u8") -> torch.Tensor:
        torch.cuda.synchronize()
        return self.t[: self.nbytes].cpu().view(TORCH_DTYPES[dtype])


class _CudaArray:
    """`__cuda_array_interface__` over a raw device pointer, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class HostBuf(Buf):
    def __init__(self, nbytes: int) -> None:
        from client import hostmem

        self.nbytes = nbytes
        self.b = hostmem.alloc(max(nbytes, 1))
        self.ptr = self.b.ptr

    def write(self, src: torch.Tensor) -> None:
        raw = src.contiguous().view(-1).view(torch.uint8).numpy()
        self.b.view(np.uint8)[: raw.size] = raw

    def read(self, dtype: str = "u8") -> torch.Tensor:
        return torch.from_numpy(self.b.view(np.uint8)[: self.nbytes].copy()).view(TORCH_DTYPES[dtype])


class RawHostBuf(Buf):
    """Host memory at a pointer we did not allocate (symmetric_alloc on the host engine)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes

    def write(self, src: torch.Tensor) -> None:
        raw = src.contiguous().view(-1).view(torch.uint8).numpy()
        ctypes.memmove(self.ptr, raw.ctypes.data, raw.size)

    def read(self, dtype: str = "u8") -> torch.Tensor:
        raw = ctypes.string_at(self.ptr, self.nbytes)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(TORCH_DTYPES[dtype])


class Mem:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "cuda":
            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda")  # the primary context, current: the client queries pointers in it

    def alloc(self, nbytes: int) -> Buf:
        return CudaBuf(nbytes) if self.kind == "cuda" else HostBuf(nbytes)

    def load(self, data: torch.Tensor) -> Buf:
        buf = self.alloc(data.numel() * data.element_size())
        buf.write(data)
        return buf

    def wrap(self, ptr: int, nbytes: int) -> Buf:
        """A pointer from symmetric_alloc, valid in this process."""
        if self.kind == "cuda":
            t = torch.as_tensor(_CudaArray(ptr, nbytes), device="cuda")
            return CudaBuf(nbytes, t)
        return RawHostBuf(ptr, nbytes)

    def stream(self) -> int:
        return int(torch.cuda.current_stream().cuda_stream) if self.kind == "cuda" else 0

    def sync(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()


# ---- data and references ------------------------------------------------------------------------

def gen(seed: int, rank: int, numel: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype == "bf16":
        return (torch.randn(numel, generator=g) * 4).to(torch.bfloat16)
    if dtype == "f32":
        return torch.randn(numel, generator=g) * 100
    if dtype == "i32":
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32)
    return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)


def reduce_ref(inputs: list[torch.Tensor], dtype: str, op: str) -> torch.Tensor:
    """Rank order, float sums accumulated in float32 and rounded once (for 1 or 2 ranks
    that is what NCCL's ring computes too)."""
    if op == "max":
        return torch.stack(inputs).amax(0)
    if dtype in ("bf16", "f32"):
        acc = inputs[0].float().clone()
        for x in inputs[1:]:
            acc += x.float()
        return acc.to(TORCH_DTYPES[dtype])
    total = torch.stack([x.long() for x in inputs]).sum(0)
    if dtype == "u8":
        return (total % 256).to(torch.uint8)
    return total.to(torch.int32)


def compare(got: torch.Tensor, want: torch.Tensor, dtype: str) -> str:
    """'' when bit-equal; a note when float results differ within one rounding; raises otherwise."""
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    if torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
        return ""
    bad = (got != want).nonzero()
    first = int(bad[0]) if bad.numel() else -1
    if dtype in ("bf16", "f32"):
        diff = (got.double() - want.double()).abs()
        ulp = 2.0 ** -7 if dtype == "bf16" else 2.0 ** -23
        tol = want.double().abs() * ulp + 1e-30
        if bool((diff <= tol).all()):
            return f"{bad.numel()} elems differ by <=1 ulp (not bit-exact)"
        raise AssertionError(f"{bad.numel()}/{got.numel()} elems differ, max |diff| {float(diff.max()):.4g}; "
                             f"first at {first}: got {got[first].item()} want {want[first].item()}")
    raise AssertionError(f"{bad.numel()}/{got.numel()} elems differ; first at {first}: "
                         f"got {got[first].item()} want {want[first].item()}")


# ---- connecting -------------------------------------------------------------------------------

def connect(a: dict[str, Any]) -> Any:
    from client import DaemonBackend

    return DaemonBackend(a["sock"], a["world"], a["rank"], a["n"], device=a.get("device"),
                         bootstrap=a.get("bootstrap"), timeout=float(a.get("timeout", 20.0)))


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def heal(comm: Any, deadline: float) -> str:
    """After a failed check: if the world failed, rebuild it (every rank does this)."""
    try:
        if comm.is_healthy():
            return ""
    except Exception as exc:
        return f"is_healthy raised {error_text(exc)}"
    while True:
        try:
            comm.attempt_reconnect()
            return "world rebuilt"
        except Exception as exc:
            if time.monotonic() > deadline:
                return f"reconnect failed: {error_text(exc)}"
            time.sleep(0.2)


# ---- role: calls ------------------------------------------------------------------------------

def role_calls(a: dict[str, Any]) -> dict[str, Any]:
    """Every CommBackend call, each checked against references on random data."""
    mem = Mem(a["mem"])
    rank, n, seed = a["rank"], a["n"], a.get("seed", 1)
    t0 = time.monotonic()
    comm = connect(a)
    out: dict[str, Any] = {"join_s": round(time.monotonic() - t0, 3), "engine": getattr(comm, "engine", None),
                           "checks": {}}
    numel = a.get("numel", (1 << 20) + 3)

    def all_reduce(dtype: str | None, op: str | None, *, asynchronous: bool = False,
                   register: bool = False) -> str:
        d = dtype or "bf16"
        data = [gen(seed, r, numel, d) for r in range(n)]
        buf = mem.load(data[rank])
        kwargs = {k: v for k, v in (("dtype", dtype), ("op", op)) if v is not None}
        handle = comm.register_buffer(buf.ptr, buf.nbytes) if register else None
        if asynchronous:
            comm.all_reduce_async(buf.ptr, buf.nbytes, mem.stream(), **kwargs)
            mem.sync()
        else:
            comm.all_reduce(buf.ptr, buf.nbytes, **kwargs)
        note = compare(buf.read(d), reduce_ref(data, d, op or "sum"), d)
        if handle is not None:
            comm.deregister_buffer(handle)
            note = f"handle {handle}; {note}".rstrip("; ")
        return note

    def add_kernel() -> str:
        comm.set_add_kernel(0xADD)  # the worker's kernel handle means nothing to the daemon
        comm.barrier()  # both ranks have set it before the sum
        time.sleep(2)  # NVRTC compiles off the daemon's loop; until then NCCL sums (the same result)
        return all_reduce(None, None)

    def all_gather() -> str:
        nbytes = (1 << 20) + 5
        data = [gen(seed + 1, r, nbytes, "u8") for r in range(n)]
        send, recv = mem.load(data[rank]), mem.alloc(nbytes * n)
        comm.all_gather(send.ptr, recv.ptr, nbytes)
        return compare(recv.read(), torch.cat(data), "u8")

    def reduce_scatter() -> str:
        share = (1 << 20) + 7
        data = [gen(seed + 2, r, share * n, "u8") for r in range(n)]
        send, recv = mem.load(data[rank]), mem.alloc(share)
        comm.reduce_scatter(send.ptr, recv.ptr, share)
        want = reduce_ref(data, "u8", "sum")[rank * share:(rank + 1) * share]
        return compare(recv.read(), want, "u8")

    def broadcast(root: int) -> Callable[[], str]:
        def check() -> str:
            nbytes = (4 << 20) + 1
            data = gen(seed + 3 + root, root, nbytes, "u8")
            buf = mem.load(data if rank == root else torch.zeros(nbytes, dtype=torch.uint8))
            comm.broadcast(buf.ptr, nbytes, root)
            return compare(buf.read(), data, "u8")
        return check

    def barrier() -> str:
        t = time.perf_counter()
        comm.barrier()
        return f"{(time.perf_counter() - t) * 1e3:.2f} ms"

    def send_recv() -> str:
        nbytes = (2 << 20) + 3
        peer = 1 - rank if rank < 2 else None
        if peer is None:
            return "rank >= 2 idle"
        mine, theirs = gen(seed + 10 + rank, rank, nbytes, "u8"), gen(seed + 10 + peer, peer, nbytes, "u8")
        send, recv = mem.load(mine), mem.alloc(nbytes)
        if rank == 0:
            comm.send_to(send.ptr, nbytes, 1, mem.stream())
            comm.recv_from(recv.ptr, nbytes, 1, mem.stream())
        else:
            comm.recv_from(recv.ptr, nbytes, 0, mem.stream())
            comm.send_to(send.ptr, nbytes, 0, mem.stream())
        mem.sync()
        return compare(recv.read(), theirs, "u8")

    def recv_command() -> str:
        value = torch.tensor([0xC0FFEE01 - (1 << 32)], dtype=torch.int32)  # as u32: 0xC0FFEE01
        buf = mem.load(value if rank == 0 else torch.zeros(1, dtype=torch.int32))
        if rank == 0:
            comm.broadcast(buf.ptr, 4, 0)
        else:
            comm.recv_command_u32(buf.ptr, 0)
        return compare(buf.read("i32"), value, "i32")

    def symmetric() -> str:
        numel_s = 1 << 20
        data = [gen(seed + 20, r, numel_s, "bf16") for r in range(n)]
        ptr = comm.symmetric_alloc(numel_s * 2)
        try:
            buf = mem.wrap(ptr, numel_s * 2)
            buf.write(data[rank])
            comm.all_reduce(ptr, numel_s * 2)
            return compare(buf.read("bf16"), reduce_ref(data, "bf16", "sum"), "bf16")
        finally:
            comm.symmetric_free(ptr)

    def group() -> str:
        a_in = [gen(seed + 30, r, 4099, "f32") for r in range(n)]
        b_in = [gen(seed + 31, r, 777, "i32") for r in range(n)]
        ba, bb = mem.load(a_in[rank]), mem.load(b_in[rank])
        comm.group_start()
        comm.all_reduce(ba.ptr, ba.nbytes, dtype="f32")
        comm.all_reduce(bb.ptr, bb.nbytes, dtype="i32", op="max")
        comm.group_end()
        return "; ".join(x for x in (compare(ba.read("f32"), reduce_ref(a_in, "f32", "sum"), "f32"),
                                     compare(bb.read("i32"), reduce_ref(b_in, "i32", "max"), "i32")) if x)

    checks: list[tuple[str, Callable[[], str]]] = [
        ("all_reduce bf16 sum (default)", lambda: all_reduce(None, None)),
        ("all_reduce f32 sum", lambda: all_reduce("f32", "sum")),
        ("all_reduce f32 max", lambda: all_reduce("f32", "max")),
        ("all_reduce i32 sum", lambda: all_reduce("i32", "sum")),
        ("all_reduce i32 max", lambda: all_reduce("i32", "max")),
        ("all_gather", all_gather),
        ("reduce_scatter u8 sum (default)", reduce_scatter),
        *[(f"broadcast root={r}", broadcast(r)) for r in range(n)],
        ("barrier", barrier),
        ("send_to/recv_from", send_recv),
        ("recv_command_u32", recv_command),
        ("all_reduce_async bf16", lambda: all_reduce(None, None, asynchronous=True)),
        ("register_buffer + all_reduce", lambda: all_reduce("f32", "sum", register=True)),
        ("symmetric_alloc + all_reduce", symmetric),
        ("group_start/end", group),
        # last: from here on a 2-rank world sums bf16 by exchange + the daemon's add kernel
        ("set_add_kernel + all_reduce bf16", add_kernel),
    ]
    for i, (name, check) in enumerate(checks):
        if n == 1 and name in ("send_to/recv_from", "recv_command_u32"):
            out["checks"][name] = {"ok": None, "note": "n/a with one rank", "s": 0.0}
            continue
        t = time.monotonic()
        try:
            if os.environ.get("GPU_CHECK_BREAK") == name and rank == n - 1:  # harness self-test
                raise RuntimeError("injected failure (GPU_CHECK_BREAK)")
            note = check()
            result = {"ok": True, "note": note}
        except Exception as exc:
            healed = heal(comm, time.monotonic() + 30)
            result = {"ok": False, "note": error_text(exc) + (f" [{healed}]" if healed else "")}
        result["s"] = round(time.monotonic() - t, 3)
        # every rank starts the next check together, whatever this one did: a rank that failed
        # alone must not run ahead into the next collective (each would mismatch the next)
        synced = sync(a.get("sync_dir"), f"check{i}", comm, rank, n, time.monotonic() + 60)
        if synced:
            result["note"] = f"{result['note']} [{synced}]".lstrip()
        out["checks"][name] = result
        emit("EVENT", "check", {"name": name, **result})
    comm.close()
    return out


def sync(sync_dir: str | None, tag: str, comm: Any, rank: int, n: int, deadline: float) -> str:
    """A barrier over files in `sync_dir`, outside the world being tested. While waiting, a
    world that failed meanwhile is rebuilt (the other ranks do the same where they wait)."""
    if not sync_dir or n == 1:
        return ""
    Path(sync_dir, f"{tag}.{rank}").touch()
    note = ""
    while not all(Path(sync_dir, f"{tag}.{r}").exists() for r in range(n)):
        if time.monotonic() > deadline:
            return "sync timed out"
        try:
            healthy = comm.is_healthy()
        except Exception:
            healthy = True
        if not healthy:
            note = heal(comm, min(deadline, time.monotonic() + 30))
        time.sleep(0.005)
    return note


# ---- role: ordering ----------------------------------------------------------------------------

def sleep_cycles_for(ms: float) -> int:
    """Cycles of torch.cuda._sleep that take about `ms` on this GPU (calibrated with events)."""
    probe = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(5 * probe)  # the clock rises from idle (345 MHz) under load (~1980 MHz)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


def role_ordering(a: dict[str, Any]) -> dict[str, Any]:
    """A long kernel writes the buffer right before the call; the result must include it."""
    mem = Mem(a["mem"])
    rank, n = a["rank"], a["n"]
    comm = connect(a)
    numel = a.get("numel", 8 << 20)  # bf16: 16 MiB
    want_sum = float(sum(r + 1 for r in range(n)))
    out: dict[str, Any] = {"checks": {}}

    def record(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            res = fn()
            res.setdefault("ok", True)
        except Exception as exc:
            res = {"ok": False, "note": error_text(exc), "trace": traceback.format_exc()[-800:]}
            res["note"] += f" [{heal(comm, time.monotonic() + 20)}]"
        synced = sync(a.get("sync_dir"), f"order-{len(out['checks'])}", comm, rank, n, time.monotonic() + 60)
        if synced:
            res["note"] = f"{res.get('note', '')} [{synced}]".lstrip()
        out["checks"][name] = res
        emit("EVENT", "check", {"name": name, **res})

    if mem.kind == "cuda":
        sleep_ms = float(a.get("sleep_ms", 300))
        cycles = sleep_cycles_for(sleep_ms)
        t = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        comm.all_reduce(t.data_ptr(), t.nbytes)  # warm: the buffer's import is not what we time

        def async_side_stream() -> dict[str, Any]:
            t.zero_()
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            slept = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                slept[0].record()
                torch.cuda._sleep(cycles)
                slept[1].record()
                t.add_(rank + 1)  # the write the reduce must see
                began = time.perf_counter()
                comm.all_reduce_async(t.data_ptr(), t.nbytes, s.cuda_stream)
                returned_ms = (time.perf_counter() - began) * 1e3
                t.add_(100)  # must run after the reduce: the stream waits the daemon's done-event
            torch.cuda.synchronize()
            got = t.float().cpu()
            want = want_sum + 100
            bad = int((got != want).sum())
            res: dict[str, Any] = {"returned_ms": round(returned_ms, 2), "sleep_ms": sleep_ms, "bad": bad,
                                   "kernel_ms": round(slept[0].elapsed_time(slept[1]), 2),
                                   "got0": float(got[0]), "want": want, "ok": bad == 0}
            if bad:
                res["note"] = (f"{bad} elems wrong, got[0]={float(got[0])}, want {want} "
                               f"({want + 100 * (n - 1)}: the add after the call ran before the reduce; "
                               f"{100 + rank + 1}: the reduce missed the write before the call)")
            return res

        def sync_default_stream() -> dict[str, Any]:
            t.zero_()
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t.add_(rank + 1)  # default stream, no host sync before the call
            began = time.perf_counter()
            comm.all_reduce(t.data_ptr(), t.nbytes)
            took = (time.perf_counter() - began) * 1e3
            got = t.float().cpu()
            bad = int((got != want_sum).sum())
            res: dict[str, Any] = {"call_ms": round(took, 2), "bad": bad, "got0": float(got[0]),
                                   "want": want_sum, "ok": bad == 0}
            if bad:
                res["note"] = f"{bad} elems wrong (got[0]={float(got[0])}, want {want_sum})"
            return res

        record("all_reduce_async after a long kernel (side stream)", async_side_stream)
        record("all_reduce after a long kernel (default stream)", sync_default_stream)
    else:
        buf = HostBuf(numel * 2)

        def host_variant(asynchronous: bool) -> Callable[[], dict[str, Any]]:
            def check() -> dict[str, Any]:
                buf.write(torch.full((numel,), float(rank + 1), dtype=torch.bfloat16))
                began = time.perf_counter()
                if asynchronous:
                    comm.all_reduce_async(buf.ptr, buf.nbytes, 0)
                else:
                    comm.all_reduce(buf.ptr, buf.nbytes)
                took = (time.perf_counter() - began) * 1e3
                got = buf.read("bf16").float()
                bad = int((got != want_sum).sum())
                return {"ok": bad == 0, "returned_ms": round(took, 2), "bad": bad,
                        "note": "host engine: completes before returning"}
            return check

        record("all_reduce_async (host)", host_variant(True))
        record("all_reduce (host)", host_variant(False))
    comm.close()
    return out


# ---- roles: fault ----------------------------------------------------------------------------------

def checked_sum(comm: Any, mem: Mem, seed: int, rank: int, n: int) -> str:
    data = [gen(seed, r, 4096, "i32") for r in range(n)]
    buf = mem.load(data[rank])
    comm.all_reduce(buf.ptr, buf.nbytes, dtype="i32")
    note = compare(buf.read("i32"), reduce_ref(data, "i32", "sum"), "i32")
    return note or "correct"


def role_victim(a: dict[str, Any]) -> dict[str, Any]:
    Mem(a["mem"])
    comm = connect(a)  # held: a collected backend would leave the world before the kill
    emit("EVENT", "joined", {"pid": os.getpid()})
    time.sleep(3600)
    comm.close()
    return {}


def role_survivor(a: dict[str, Any]) -> dict[str, Any]:
    """Wait in a big all_reduce while the other rank is killed; rebuild; check a call."""
    import client

    mem = Mem(a["mem"])
    comm = connect(a)
    out: dict[str, Any] = {}
    big = mem.alloc(a.get("big_bytes", 64 << 20))
    emit("EVENT", "in_call", {"at": time.time()})
    try:
        comm.all_reduce(big.ptr, big.nbytes)
        out.update(error=None, world_failed=False)
    except Exception as exc:
        out.update(error=type(exc).__name__, message=str(exc)[:300],
                   world_failed=isinstance(exc, client.WorldFailed))
    out["at"] = time.time()
    emit("EVENT", "error", {"at": out["at"], "error": out["error"]})
    deadline = time.monotonic() + float(a.get("rebuild_s", 30))
    errors: list[str] = []
    while True:
        try:
            comm.attempt_reconnect()
            break
        except Exception as exc:
            errors.append(type(exc).__name__)
            if time.monotonic() > deadline:
                out.update(rebuilt=False, reconnect_errors=errors[-5:])
                return out
            time.sleep(0.2)
    out.update(rebuilt=True, reconnect_errors=errors[-5:], epoch=getattr(comm, "epoch", None))
    check_after_rebuild(comm, mem, a, out)
    out["rebuilt_at"] = time.time()
    comm.close()
    return out


def role_replacement(a: dict[str, Any]) -> dict[str, Any]:
    """The new process in the killed rank's slot: its hello counts as its attempt_reconnect."""
    mem = Mem(a["mem"])
    comm = connect(a)
    out: dict[str, Any] = {"epoch": getattr(comm, "epoch", None)}
    check_after_rebuild(comm, mem, a, out)
    comm.close()
    return out


def check_after_rebuild(comm: Any, mem: Mem, a: dict[str, Any], out: dict[str, Any]) -> None:
    """One checked all_reduce and a barrier in the rebuilt world; the outcome goes in `out`."""
    try:
        out["check"] = checked_sum(comm, mem, a.get("seed", 9), a["rank"], a["n"])
        comm.barrier()
        out["ok_after"] = True
    except Exception as exc:
        out.update(ok_after=False, check=error_text(exc))


# ---- roles: benchmark ----------------------------------------------------------------------------

def timed_loop(call: Callable[[], None], iters: int, warmup: int, budget_s: float) -> list[float]:
    for _ in range(warmup):
        call()
    times: list[float] = []
    end = time.monotonic() + budget_s
    for _ in range(iters):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
        if time.monotonic() > end and len(times) >= 3:
            break
    return times


def bench_rows(sizes: list[list[int]], run: Callable[[int, int], list[float]],
               n: int) -> list[dict[str, Any]]:
    rows = []
    for nbytes, iters in sizes:
        times = run(nbytes, iters)
        med = statistics.median(times)
        rows.append({"bytes": nbytes, "iters": len(times), "median_us": round(med * 1e6, 2),
                     "busbw_GBps": round(2 * (n - 1) / n * nbytes / med / 1e9, 3)})
    return rows


def role_bench(a: dict[str, Any]) -> dict[str, Any]:
    """The daemon path: a synchronous bf16 all_reduce per iteration, timed on each rank."""
    mem = Mem(a["mem"])
    comm = connect(a)
    n = a["n"]

    def run(nbytes: int, iters: int) -> list[float]:
        buf = mem.alloc(nbytes)
        if isinstance(buf, CudaBuf):
            buf.t.zero_()
            torch.cuda.synchronize()
        comm.barrier()
        times = timed_loop(lambda: comm.all_reduce(buf.ptr, nbytes), iters, 3, a.get("per_size_s", 8))
        comm.barrier()
        return times

    rows = bench_rows(a["sizes"], run, n)
    comm.close()
    return {"rows": rows}


def role_torchbench(a: dict[str, Any]) -> dict[str, Any]:
    """In-process NCCL (gloo on a dry run): torch.distributed, same sizes, same sync per call."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if a["mem"] == "cuda" else "gloo"
    rank, n = a["rank"], a["n"]
    if backend == "nccl":
        torch.cuda.set_device(0)
    extra: dict[str, Any] = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60), **extra)
    device = "cuda" if backend == "nccl" else "cpu"
    dtype = torch.bfloat16 if backend == "nccl" else torch.float32  # gloo: f32, same bytes
    token = torch.zeros(1, device=device)

    def barrier() -> None:  # an all_reduce: NCCL's barrier guesses devices by rank
        dist.all_reduce(token)
        if device == "cuda":
            torch.cuda.synchronize()

    def run(nbytes: int, iters: int) -> list[float]:
        t = torch.zeros(max(nbytes // (2 if dtype == torch.bfloat16 else 4), 1), dtype=dtype, device=device)

        def call() -> None:
            dist.all_reduce(t)
            if device == "cuda":
                torch.cuda.synchronize()

        barrier()
        times = timed_loop(call, iters, 3, a.get("per_size_s", 8))
        barrier()
        return times

    rows = bench_rows(a["sizes"], run, n)
    version = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else "gloo"
    dist.destroy_process_group()
    return {"rows": rows, "backend": backend, "version": version}


ROLES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "calls": role_calls, "ordering": role_ordering, "victim": role_victim, "survivor": role_survivor,
    "replacement": role_replacement, "bench": role_bench, "torchbench": role_torchbench,
}


def main() -> int:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = ROLES[role](args)
    except Exception as exc:
        traceback.print_exc()
        emit("RESULT", payload={"fatal": error_text(exc)})
        return 1
    emit("RESULT", payload=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
