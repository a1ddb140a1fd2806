"""Functions that run inside worker processes, one per rank, each with its own DaemonBackend.

They return plain data (bytes, ints, tuples) for the test to check against numpy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import threading
import time
from typing import Any

import numpy as np

import proto
from client import CommError, DaemonBackend, hostmem
from tests.integration.data import make_input, reduce_reference, signed_zeros
from tests.integration.harness import back_to, held_at_rest

TIMEOUT = 20.0


def connect(sock: str, world: str, rank: int, n: int, timeout: float = TIMEOUT) -> DaemonBackend:
    """`sock` is a socket path, or `path@host:port` for a world whose root is at host:port."""
    path, _, bootstrap = sock.partition("@")
    return DaemonBackend(path, world, rank, n, timeout=timeout, bootstrap=bootstrap or None)


def reconnect_until(comm: DaemonBackend, deadline: float) -> list[str]:
    """attempt_reconnect until it succeeds (the other ranks, a daemon or the network may
    not be back yet); returns the errors of the attempts that failed."""
    errors: list[str] = []
    while True:
        try:
            comm.attempt_reconnect()
            return errors
        except Exception as exc:
            errors.append(type(exc).__name__)
            assert time.monotonic() < deadline, errors
            time.sleep(0.2)


def socket_path(sock: str) -> str:
    return sock.partition("@")[0]


def _error_name(call: Any, *args: Any) -> str:
    """The class name of what `call(*args)` raised ("no error" if nothing)."""
    try:
        call(*args)
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def _load(data: np.ndarray, offset: int = 0, extra: int = 0) -> hostmem.HostBuffer:
    buf = hostmem.alloc(offset + data.nbytes + extra)
    buf.view(np.uint8)[offset:offset + data.nbytes] = data.view(np.uint8)
    return buf


def _read(buf: hostmem.HostBuffer, offset: int, nbytes: int) -> bytes:
    return bytes(buf.view(np.uint8)[offset:offset + nbytes])


def all_reduce(sock: str, world: str, rank: int, n: int, nelem: int, dtype: str | None,
               op: str | None, seed: int, offset: int = 0, use_async: bool = False) -> bytes:
    data = make_input(seed, rank, nelem, dtype or "bf16", op or "sum")
    with connect(sock, world, rank, n) as comm:
        buf = _load(data, offset, extra=8)
        kwargs = {k: v for k, v in (("dtype", dtype), ("op", op)) if v is not None}
        if use_async:
            comm.all_reduce_async(buf.ptr + offset, data.nbytes, 0, **kwargs)
        else:
            comm.all_reduce(buf.ptr + offset, data.nbytes, **kwargs)
        return _read(buf, offset, data.nbytes)


def all_reduce_repeated(sock: str, world: str, rank: int, n: int, nelem: int, dtype: str,
                        calls: int) -> list[int]:
    """`calls` all_reduces (sum) of one buffer, new inputs each; the calls whose result was
    not the exact sum (integers: any order gives it)."""
    wrong = []
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(make_input(0, rank, nelem, dtype, "sum").nbytes)
        for call in range(calls):
            data = make_input(call, rank, nelem, dtype, "sum")
            buf.view(np.uint8)[:] = data.view(np.uint8)
            comm.all_reduce(buf.ptr, data.nbytes, dtype=dtype)
            inputs = [make_input(call, r, nelem, dtype, "sum") for r in range(n)]
            want = reduce_reference(inputs, dtype, "sum")
            if _read(buf, 0, data.nbytes) != want.tobytes():
                wrong.append(call)
    return wrong


def signed_zero_reductions(sock: str, world: str, rank: int, n: int, nelem: int, dtype: str,
                           op: str) -> tuple[bytes, bytes]:
    """all_reduce of `signed_zeros`, then reduce_scatter of them with shares of `nelem`."""
    data = signed_zeros(rank, nelem, dtype)
    whole = signed_zeros(rank, nelem * n, dtype)
    with connect(sock, world, rank, n) as comm:
        buf, send, recv = _load(data), _load(whole), hostmem.alloc(data.nbytes)
        comm.all_reduce(buf.ptr, data.nbytes, dtype=dtype, op=op)
        comm.reduce_scatter(send.ptr, recv.ptr, data.nbytes, dtype=dtype, op=op)
        return _read(buf, 0, data.nbytes), _read(recv, 0, data.nbytes)


def checked_rounds(comm: DaemonBackend, view: np.ndarray, ptr: int, rank: int, first: int,
                   rounds: int) -> None:
    """`rounds` i32 sums of `view` (at `ptr`) in a 2-rank world, each checked: rank r puts
    first * (r + 1) + i, both get 3 * first + 2 * i."""
    for i in range(rounds):
        view[:] = first * (rank + 1) + i
        comm.all_reduce(ptr, view.nbytes, dtype="i32")
        assert (view == 3 * first + 2 * i).all(), (i, view[:4])


def rounds_in_world(sock: str, world: str, rank: int, n: int, nelem: int, first: int, rounds: int) -> None:
    """Join, `checked_rounds` on a buffer of `nelem` i32s, then a barrier."""
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(4 * nelem)
        checked_rounds(comm, buf.view(np.int32), buf.ptr, rank, first, rounds)
        comm.barrier()


def all_gather(sock: str, world: str, rank: int, n: int, nbytes: int, seed: int) -> bytes:
    data = make_input(seed, rank, nbytes, "u8", "sum")
    with connect(sock, world, rank, n) as comm:
        send = _load(data)
        recv = hostmem.alloc(nbytes * n)
        recv.view(np.uint8)[:] = 0xEE
        comm.all_gather(send.ptr, recv.ptr, nbytes)
        return _read(recv, 0, nbytes * n)


def reduce_scatter(sock: str, world: str, rank: int, n: int, share_elems: int, dtype: str | None,
                   op: str | None, seed: int) -> bytes:
    data = make_input(seed, rank, share_elems * n, dtype or "u8", op or "sum")
    share = data.nbytes // n
    with connect(sock, world, rank, n) as comm:
        send = _load(data)
        recv = hostmem.alloc(share)
        kwargs = {k: v for k, v in (("dtype", dtype), ("op", op)) if v is not None}
        comm.reduce_scatter(send.ptr, recv.ptr, share, **kwargs)
        return _read(recv, 0, share)


def in_place_and_overlapping(sock: str, world: str, rank: int, n: int, nbytes: int,
                             seed: int) -> tuple[bytes, bytes, list[str]]:
    """all_gather and reduce_scatter in place (the rank's block of one buffer), then each
    with its two spans overlapping otherwise (their errors), then a barrier."""
    data = make_input(seed, rank, nbytes * n, "u8", "sum")
    with connect(sock, world, rank, n) as comm:
        whole = _load(data, extra=8)  # (room past the end for the misplaced block below)
        block = whole.ptr + rank * nbytes
        comm.all_gather(block, whole.ptr, nbytes)
        gathered = _read(whole, 0, nbytes * n)
        whole.view(np.uint8)[:nbytes * n] = data
        comm.reduce_scatter(whole.ptr, block, nbytes)
        reduced = _read(whole, rank * nbytes, nbytes)
        errors = []
        for call, args in ((comm.all_gather, (block + 1, whole.ptr, nbytes)),
                           (comm.reduce_scatter, (whole.ptr, block + 1, nbytes - 1))):
            try:
                call(*args)
                errors.append("no error")
            except CommError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        comm.barrier()
        return gathered, reduced, errors


def swap_in_one_buffer(sock: str, world: str, rank: int, n: int, nbytes: int) -> tuple[str, bytes]:
    """Ranks r and r^1 swap `nbytes` in one group: first sending from and receiving into the
    same memory (its error), then into memory of its own (what came)."""
    peer = rank ^ 1
    with connect(sock, world, rank, n) as comm:
        mine, theirs = _load(np.full(nbytes, rank + 1, np.uint8)), hostmem.alloc(nbytes)
        try:
            comm.group_start()
            comm.send_to(mine.ptr, nbytes, peer)
            comm.recv_from(mine.ptr, nbytes, peer)
            comm.group_end()
            error = "no error"
        except CommError as exc:
            error = f"{type(exc).__name__}: {exc}"
        comm.group_start()
        comm.send_to(mine.ptr, nbytes, peer)
        comm.recv_from(theirs.ptr, nbytes, peer)
        comm.group_end()
        return error, _read(theirs, 0, nbytes)


def reduce_and_pass_in_one_group(sock: str, world: str, rank: int,
                                 n: int) -> tuple[str, list[int], list[int]]:
    """Three ranks, one group each: all_reduce (i32) of their buffer, rank 1 sending rank 0
    that buffer and rank 0 receiving into its own (the error each gets; rank 2's group has
    no transfer); then ranks 0 and 1 the same with the transfer's memory apart. What the
    buffer and the transfer's other memory hold."""
    with connect(sock, world, rank, n) as comm:
        summed = _load(np.full(4, 10 ** rank, np.int32))
        received = _load(np.full(4, 7 if rank == 1 else 0, np.int32))  # (rank 1's: what it sends)
        error = "no error"
        if rank < 2:
            try:
                comm.group_start()
                comm.all_reduce(summed.ptr, 16, dtype="i32")
                if rank == 0:
                    comm.recv_from(summed.ptr, 16, 1)
                else:
                    comm.send_to(summed.ptr, 16, 0)
                comm.group_end()
            except CommError as exc:
                error = f"{type(exc).__name__}: {exc}"
        if rank == 2 or error != "no error":
            comm.group_start()
            comm.all_reduce(summed.ptr, 16, dtype="i32")
            if rank == 0:
                comm.recv_from(received.ptr, 16, 1)
            elif rank == 1:
                comm.send_to(received.ptr, 16, 0)
            comm.group_end()
        comm.barrier()
        return error, summed.view(np.int32).tolist(), received.view(np.int32).tolist()


def broadcast(sock: str, world: str, rank: int, n: int, nbytes: int, root: int, seed: int) -> bytes:
    data = make_input(seed, rank, nbytes, "u8", "sum")
    with connect(sock, world, rank, n) as comm:
        buf = _load(data)
        comm.broadcast(buf.ptr, nbytes, root)
        return _read(buf, 0, nbytes)


def barrier(sock: str, world: str, rank: int, n: int, delay: float) -> tuple[float, float]:
    with connect(sock, world, rank, n) as comm:
        comm.barrier()  # everyone connected: start the clock together
        time.sleep(delay * rank)
        arrived = time.time()
        comm.barrier()
        return arrived, time.time()


def send_recv_pairs(sock: str, world: str, rank: int, n: int, nbytes: int, seed: int) -> dict[int, bytes]:
    """Every ordered pair exchanges a message inside one group; returns what arrived from each peer."""
    with connect(sock, world, rank, n) as comm:
        outgoing = {peer: _load(make_input(seed + 1000 * rank + peer, 0, nbytes, "u8", "sum"))
                    for peer in range(n) if peer != rank}
        incoming = {peer: hostmem.alloc(nbytes) for peer in range(n) if peer != rank}
        comm.group_start()
        for peer in sorted(outgoing):
            comm.send_to(outgoing[peer].ptr, nbytes, peer, 0)
            comm.recv_from(incoming[peer].ptr, nbytes, peer, 0)
        comm.group_end()
        comm.barrier()  # our group may finish before the others' pairs: leaving would fail the world
        return {peer: _read(buf, 0, nbytes) for peer, buf in incoming.items()}


def send_then_recv(sock: str, world: str, rank: int, n: int, nbytes: int, seed: int) -> bytes:
    """Rank 0 and the last rank exchange, ungrouped: 0 sends then receives; the other the reverse."""
    last = n - 1
    mine = make_input(seed, rank, nbytes, "u8", "sum")
    with connect(sock, world, rank, n) as comm:
        out, into = _load(mine), hostmem.alloc(nbytes)
        if rank == 0:
            comm.send_to(out.ptr, nbytes, last, 7)
            comm.recv_from(into.ptr, nbytes, last, 7)
        elif rank == last:
            comm.recv_from(into.ptr, nbytes, 0, 7)
            comm.send_to(out.ptr, nbytes, 0, 7)
        comm.barrier()
        return _read(into, 0, nbytes)


def late_taker(sock: str, world: str, rank: int, n: int, what: str, nbytes: int, late: int,
               delay: float, seed: int) -> bytes:
    """Rank `late` makes its call `delay` seconds after the others, which are at theirs
    already: for "p2p" it receives what rank 1 sends it (rank 0 if it is rank 1); for
    "all_reduce" all ranks sum u8. Returns what this rank received."""
    with connect(sock, world, rank, n, timeout=TIMEOUT + delay) as comm:
        comm.barrier()  # joined: the delay below is the call's alone
        if rank == late:
            time.sleep(delay)
        received = b""
        src = 0 if late == 1 else 1
        if what == "all_reduce":
            buf = _load(make_input(seed, rank, nbytes, "u8", "sum"))
            comm.all_reduce(buf.ptr, nbytes, dtype="u8", op="sum")
            received = _read(buf, 0, nbytes)
        elif rank == src:
            out = _load(make_input(seed, rank, nbytes, "u8", "sum"))
            comm.send_to(out.ptr, nbytes, late, 0)
        elif rank == late:
            into = hostmem.alloc(nbytes)
            comm.recv_from(into.ptr, nbytes, src, 0)
            received = _read(into, 0, nbytes)
        comm.barrier()  # a rank leaving now would fail the world under the others' calls
        time.sleep(0.5)  # (the world stays while the test looks: nothing held once it is all done)
        return received


def send_unreceived(sock: str, world: str, rank: int, n: int, nbytes: int, released: str,
                    stay: float) -> str:
    """Rank 1 sends rank 0 `nbytes`, which rank 0 never receives: the send times out (the
    world fails); both ranks stay connected until `released` exists, `stay` seconds from
    the start at most. Returns what this rank's call raised ("-" for rank 0, which makes none)."""
    leave_by = time.monotonic() + stay
    with connect(sock, world, rank, n, timeout=2.0) as comm:
        outcome = "-"
        if rank == 1:
            out = _load(make_input(1, rank, nbytes, "u8", "sum"))
            outcome = _error_name(comm.send_to, out.ptr, nbytes, 0, 0)
        while not os.path.exists(released) and time.monotonic() < leave_by:
            time.sleep(0.02)
        return outcome


def command_loop(sock: str, world: str, rank: int, n: int, commands: list[int]) -> list[int]:
    """Rank 0 broadcasts each command; the others take it with recv_command_u32."""
    got = []
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(4)
        word = buf.view(np.uint32)
        for command in commands:
            if rank == 0:
                word[0] = command
                comm.broadcast(buf.ptr, 4, 0)
            else:
                time.sleep(0.01 * (len(got) % 3))  # the root often runs ahead: no deadline involved
                comm.recv_command_u32(buf.ptr, 0)
            got.append(int(word[0]))
        return got


def root_recv_command(sock: str, world: str, rank: int, n: int) -> str:
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(4)
        try:
            comm.recv_command_u32(buf.ptr, rank)
        except Exception as exc:
            comm.barrier()
            return type(exc).__name__
        return "no error"


def group_two_reduces(sock: str, world: str, rank: int, n: int, nelem: int, seed: int,
                      grouping: tuple[int, ...] | None = None) -> tuple[bytes, bytes]:
    """Two all_reduces in one group on the ranks in `grouping` (all if None), one after
    the other on the rest."""
    a = make_input(seed, rank, nelem, "f32", "sum")
    b = make_input(seed + 1, rank, nelem, "i32", "max")
    grouped = grouping is None or rank in grouping
    with connect(sock, world, rank, n) as comm:
        ba, bb = _load(a), _load(b)
        if grouped:
            comm.group_start()
        comm.all_reduce(ba.ptr, a.nbytes, dtype="f32", op="sum")
        comm.all_reduce(bb.ptr, b.nbytes, dtype="i32", op="max")
        if grouped:
            comm.group_end()
        return _read(ba, 0, a.nbytes), _read(bb, 0, b.nbytes)


def identity(sock: str, world: str, rank: int, n: int) -> tuple[int, int, bool, int]:
    with connect(sock, world, rank, n) as comm:
        facts = comm.rank(), comm.world_size(), comm.is_healthy(), comm.epoch
        comm.barrier()  # nobody leaves (failing the world) before everyone has looked
        return facts


def register_and_kernel(sock: str, world: str, rank: int, n: int, kernel: int) -> dict[str, Any]:
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(4096)
        h1 = comm.register_buffer(buf.ptr, 1024)
        h2 = comm.register_buffer(buf.ptr + 1024, 1024)
        comm.set_add_kernel(kernel)
        comm.barrier()
        from commd.status import query_status

        kernels = next(w["add_kernel"] for w in query_status(socket_path(sock), 5)["worlds"]
                       if w["name"] == world)
        comm.deregister_buffer(h1)
        errors = [_error_name(comm.deregister_buffer, handle) for handle in (h1, 999_999)]
        comm.deregister_buffer(h2)
        comm.barrier()
        return {"handles": (h1, h2), "kernels": kernels, "errors": errors}


def symmetric(sock: str, world: str, rank: int, n: int, nelem: int, seed: int) -> dict[str, Any]:
    data = make_input(seed, rank, nelem, "f32", "sum")
    with connect(sock, world, rank, n) as comm:
        ptr = comm.symmetric_alloc(data.nbytes)
        ctypes.memmove(ptr, data.ctypes.data, data.nbytes)  # the pointer is valid in this process
        comm.all_reduce(ptr, data.nbytes, dtype="f32")
        result = ctypes.string_at(ptr, data.nbytes)
        comm.symmetric_free(ptr)
        errors = [_error_name(comm.symmetric_free, bad) for bad in (ptr, 12345)]
        comm.barrier()
        return {"result": result, "errors": errors}


def symmetric_at_the_open_file_limit(sock: str, world: str, rank: int, n: int, nelem: int, seed: int,
                                     daemon_pid: int) -> dict[str, Any]:
    """Rank 1 asks for symmetric memory with its open files at their limit, so the reply's
    fd cannot come in (and waits for the daemon to be back at rest: it let go of what it
    made); then every rank allocates, reduces in and frees symmetric memory as usual."""
    data = make_input(seed, rank, nelem, "f32", "sum")
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n) as comm:
        if rank == 1:
            at_rest = held_at_rest(daemon_pid)
            out["fds before"] = sorted(os.listdir("/proc/self/fd"))
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            lowest = os.open(os.devnull, os.O_RDONLY)  # (the limit bounds an fd's number)
            os.close(lowest)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
            try:
                comm.symmetric_alloc(data.nbytes)
                out["error"] = "no error"
            except CommError as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            out["healthy"] = comm.is_healthy()
            out["fds after"] = sorted(os.listdir("/proc/self/fd"))
            if not out["healthy"]:
                return out
            back_to(daemon_pid, at_rest)
        comm.barrier()
        ptr = comm.symmetric_alloc(data.nbytes)
        ctypes.memmove(ptr, data.ctypes.data, data.nbytes)
        comm.all_reduce(ptr, data.nbytes, dtype="f32")
        out["result"] = ctypes.string_at(ptr, data.nbytes)
        comm.symmetric_free(ptr)
        comm.barrier()
    return out


def reconnect_all(sock: str, world: str, rank: int, n: int, seed: int) -> tuple[int, int, bytes]:
    data = make_input(seed, rank, 64, "f32", "sum")
    with connect(sock, world, rank, n) as comm:
        before = comm.epoch
        comm.attempt_reconnect()
        buf = _load(data)
        comm.all_reduce(buf.ptr, data.nbytes, dtype="f32")
        return before, comm.epoch, _read(buf, 0, data.nbytes)


def steady_loop(sock: str, world: str, rank: int, n: int, stop: Any, results: Any,
                running: Any, error_count: Any) -> None:
    """An unrelated world that must see zero errors while bad input hits the daemon."""
    iterations, errors = 0, []
    try:
        with connect(sock, world, rank, n) as comm:
            flag = hostmem.alloc(4)
            data = hostmem.alloc(4096)
            while True:
                flag.view(np.uint32)[0] = 1 if stop.is_set() else 0
                comm.all_reduce(flag.ptr, 4, dtype="u8", op="max")  # agree on when to stop
                if flag.view(np.uint32)[0]:
                    break
                values = make_input(iterations, rank, 1024, "f32", "sum")
                data.view(np.float32)[:] = values
                comm.all_reduce(data.ptr, 4096, dtype="f32")
                want = sum(make_input(iterations, r, 1024, "f32", "sum").astype(np.float64)
                           for r in range(n))
                if not np.allclose(data.view(np.float32), want, rtol=1e-5):
                    errors.append(f"wrong sum at iteration {iterations}")
                    with error_count.get_lock():
                        error_count.value += 1
                iterations += 1
                running.set()
            comm.barrier()
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        with error_count.get_lock():
            error_count.value += 1
    results.put((rank, iterations, errors))


def mismatch(sock: str, world: str, rank: int, n: int, kind: str) -> dict[str, Any]:
    """Rank 0 and rank 1 disagree on call 1 (for "p2p", 2 ranks: rank 0 sends rank 1 16
    bytes, rank 1 receives 8); then all ranks reconnect and agree again."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(64)
        comm.all_reduce(buf.ptr, 8)  # call 0 agrees
        try:
            if kind == "p2p":
                if rank == 0:
                    comm.send_to(buf.ptr, 16, 1, 0)
                else:
                    comm.recv_from(buf.ptr, 8, 0, 0)
            elif rank == 1 and kind == "bytes":
                comm.all_reduce(buf.ptr, 16)
            elif rank == 1 and kind == "op":
                comm.broadcast(buf.ptr, 8, 0)
            elif rank == 1 and kind == "dtype":
                comm.all_reduce(buf.ptr, 8, dtype="f32")
            else:
                comm.all_reduce(buf.ptr, 8)
            out["error"] = None
        except Exception as exc:
            out["error"] = (type(exc).__name__, str(exc))
        out["healthy_after"] = comm.is_healthy()
        comm.attempt_reconnect()
        out["epoch"] = comm.epoch
        data = make_input(5, rank, 16, "f32", "sum")
        buf.view(np.float32)[:16] = data
        comm.all_reduce(buf.ptr, 64, dtype="f32")
        out["result"] = bytes(buf.view(np.uint8))
        out["healthy_end"] = comm.is_healthy()
        comm.barrier()
    return out


def leave_early(sock: str, world: str, rank: int, n: int) -> dict[str, Any]:
    """Rank 1 leaves; rank 0 sees the failure in a pending barrier and in is_healthy,
    then a fresh connection takes rank 1 and the world is rebuilt at epoch 2."""
    out: dict[str, Any] = {}
    comm = connect(sock, world, rank, n)
    if rank == 1:
        comm.close()
        time.sleep(0.5)
        with connect(sock, world, rank, n) as again:  # the new process in rank 1's slot
            out["epoch"] = again.epoch
            again.barrier()
        return out
    try:
        comm.barrier()
        out["barrier"] = "returned"
    except Exception as exc:
        out["barrier"] = type(exc).__name__
    out["healthy"] = comm.is_healthy()
    try:
        comm.barrier()
    except Exception as exc:
        out["fast_fail"] = type(exc).__name__
    comm.attempt_reconnect()
    out["epoch"] = comm.epoch
    out["healthy_end"] = comm.is_healthy()
    comm.barrier()
    comm.close()
    return out


def wait_for_command(sock: str, world: str, rank: int, n: int) -> tuple[str, str]:
    """Rank 1 blocks in recv_command_u32, rank 0 in a recv nobody sends, until something
    ends them; report how each ended."""
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(4)
        try:
            if rank == 0:
                comm.recv_from(buf.ptr, 4, 1)
            else:
                comm.recv_command_u32(buf.ptr, 0)
            return ("returned", "")
        except Exception as exc:
            return (type(exc).__name__, str(exc))


def threads_share_a_backend(sock: str, world: str, rank: int, n: int, rounds: int) -> dict[str, Any]:
    """Rank 1 waits in recv_command_u32 on one thread while other threads make calls
    on the same backend; rank 0 sends the command once they are done."""
    import threading

    out: dict[str, Any] = {"handles": [], "errors": []}
    with connect(sock, world, rank, n) as comm:
        cmd = hostmem.alloc(4)
        bufs = [hostmem.alloc(256) for _ in range(4)]
        if rank == 0:
            comm.recv_from(cmd.ptr, 4, 1)  # the other rank's helper threads are done
            cmd.view(np.uint32)[0] = 0xC0FFEE
            comm.broadcast(cmd.ptr, 4, 0)
            comm.barrier()
            return out

        def waiter() -> None:
            try:
                comm.recv_command_u32(cmd.ptr, 0)
            except Exception as exc:
                out["errors"].append(repr(exc))

        def worker(i: int) -> None:
            try:
                for _ in range(rounds):
                    handle = comm.register_buffer(bufs[i].ptr, 128)
                    out["handles"].append(handle)
                    comm.deregister_buffer(handle)
            except Exception as exc:
                out["errors"].append(repr(exc))

        threads = [threading.Thread(target=waiter)] + [
            threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(30)
        done = hostmem.alloc(4)
        comm.send_to(done.ptr, 4, 0)  # p2p: does not disturb the pending collective
        threads[0].join(30)
        comm.barrier()
        out["command"] = int(cmd.view(np.uint32)[0])
    return out


def timed_barrier(sock: str, world: str, rank: int, n: int, idle_s: float) -> tuple[str, float, bool]:
    """Rank 0 waits in a barrier (how it ends, and when: wall-clock time); the others idle
    until their world failed, `idle_s` at most, then report health."""
    with connect(sock, world, rank, n) as comm:
        if rank != 0:
            # (a failed world stays failed until attempt_reconnect: once unhealthy, what
            # is_healthy would say at `idle_s` is known)
            leave_by = time.monotonic() + idle_s
            while comm.is_healthy() and time.monotonic() < leave_by:
                time.sleep(0.02)
            return "idle", time.time(), comm.is_healthy()
        try:
            comm.barrier()
            return "returned", time.time(), comm.is_healthy()
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc), time.time(), comm.is_healthy()


def join_only(sock: str, world: str, rank: int, n: int, timeout: float) -> tuple[str, str]:
    try:
        with connect(sock, world, rank, n, timeout=timeout):
            return "joined", ""
    except Exception as exc:
        return type(exc).__name__, str(exc)


def reconnect_then_wait(sock: str, world: str, rank: int, n: int) -> bytes:
    """Rebuild at epoch 2, then rank 1 lets rank 0 wait in an all_reduce for a while."""
    with connect(sock, world, rank, n) as comm:
        comm.attempt_reconnect()
        if rank == 1:
            time.sleep(1.5)
        buf = _load(make_input(3, rank, 32, "i64", "sum"))
        comm.all_reduce(buf.ptr, 32 * 8, dtype="i64")
        comm.barrier()
        return _read(buf, 0, 32 * 8)


def stall(sock: str, world: str, rank: int, n: int, timeout: float, hold_s: float) -> tuple[str, str, float]:
    """Rank 0 all_reduces; rank 1 never makes that call, holds its connection, then leaves."""
    with connect(sock, world, rank, n, timeout=timeout) as comm:
        buf = hostmem.alloc(64)
        start = time.monotonic()
        if rank == 1:
            comm.barrier()  # call #0, which rank 0 makes too
            time.sleep(hold_s)
            return "held", str(comm.is_healthy()), time.monotonic() - start
        comm.barrier()
        try:
            comm.all_reduce(buf.ptr, 64)
            return "returned", "", time.monotonic() - start
        except Exception as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start


def slow_commands(sock: str, world: str, rank: int, n: int, timeout: float, pause: float) -> list[int]:
    """Two commands, the root waiting `pause` (> timeout) before each: no deadline applies."""
    got = []
    with connect(sock, world, rank, n, timeout=timeout) as comm:
        comm.barrier()
        buf = hostmem.alloc(4)
        for command in (5, 6):
            if rank == 0:
                time.sleep(pause)
                buf.view(np.uint32)[0] = command
                comm.broadcast(buf.ptr, 4, 0)
            else:
                comm.recv_command_u32(buf.ptr, 0)
            got.append(int(buf.view(np.uint32)[0]))
        comm.barrier()
    return got


def survive_restart(sock: str, world: str, rank: int, n: int, seed: int) -> dict[str, Any]:
    """Use plain, registered and symmetric memory; wait until the daemon is gone (the test
    kills it and starts a new one); reconnect; use the same memory again."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n, timeout=15) as comm:
        data = make_input(seed, rank, 256, "f32", "sum")
        buf = _load(data)
        handle = comm.register_buffer(buf.ptr, buf.nbytes)
        sym = comm.symmetric_alloc(1024)
        comm.all_reduce(buf.ptr, data.nbytes, dtype="f32")
        out["before"] = comm.epoch
        comm.barrier()
        deadline = time.monotonic() + 20
        while comm.is_healthy():  # until the kill is noticed
            assert time.monotonic() < deadline, "the daemon never went away"
            time.sleep(0.05)
        comm.attempt_reconnect()
        out["after"] = comm.epoch
        buf.view(np.float32)[:] = data
        comm.all_reduce(buf.ptr, data.nbytes, dtype="f32")
        out["result"] = _read(buf, 0, data.nbytes)
        ctypes.memset(sym, rank + 1, 1024)
        comm.all_reduce(sym, 1024, dtype="u8", op="max")
        out["symmetric"] = ctypes.string_at(sym, 4)
        comm.deregister_buffer(handle)
        comm.symmetric_free(sym)
        comm.barrier()
    return out


def ride_out_a_cut(sock: str, world: str, rank: int, n: int, seed: int) -> dict[str, Any]:
    """all_reduce; wait for the network cut to be noticed; attempt_reconnect until the
    network is back; all_reduce again."""
    out: dict[str, Any] = {"errors": []}
    with connect(sock, world, rank, n, timeout=10) as comm:
        data = make_input(seed, rank, 64, "i32", "sum")
        buf = _load(data)
        comm.all_reduce(buf.ptr, data.nbytes, dtype="i32")
        comm.barrier()
        deadline = time.monotonic() + 20
        while comm.is_healthy():
            assert time.monotonic() < deadline, "the cut was never noticed"
            time.sleep(0.01)
        out["at"] = time.time()
        out["errors"] = reconnect_until(comm, deadline)  # the network may still be cut
        out["epoch"] = comm.epoch
        buf.view(np.uint8)[:] = data.view(np.uint8)
        comm.all_reduce(buf.ptr, data.nbytes, dtype="i32")
        out["rebuilt_at"] = time.time()
        out["result"] = _read(buf, 0, data.nbytes)
        comm.barrier()
    return out


def join_and_wait(sock: str, world: str, rank: int, n: int) -> None:
    """A victim: join, then wait to be killed."""
    with connect(sock, world, rank, n):
        time.sleep(3600)


def _summed(comm: DaemonBackend, seed: int, rank: int, nelem: int, dtype: str) -> bytes:
    """This rank's `make_input`, all_reduced (sum): the call a rebuilt world is checked with."""
    data = _load(make_input(seed, rank, nelem, dtype, "sum"))
    comm.all_reduce(data.ptr, data.nbytes, dtype=dtype)
    return _read(data, 0, data.nbytes)


def survive_a_kill(sock: str, world: str, rank: int, n: int, what: str, seed: int) -> dict[str, Any]:
    """Wait in `what` while the other rank is killed; note when and how it ended; then
    rebuild the world with whoever takes the lost rank, and check a call."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n) as comm:
        big = hostmem.alloc(64 << 20)
        try:
            if what == "all_reduce":
                comm.all_reduce(big.ptr, big.nbytes)
            elif what == "barrier":
                comm.barrier()
            else:
                comm.recv_command_u32(big.ptr, 0)
            out["error"] = None
        except Exception as exc:
            out["error"] = type(exc).__name__
        out["at"] = time.time()
        comm.attempt_reconnect()
        out["epoch"] = comm.epoch
        out["result"] = _summed(comm, seed, rank, 128, "i64")
        out["rebuilt_at"] = time.time()
        comm.barrier()
    return out


def replacement(sock: str, world: str, rank: int, n: int, seed: int) -> bytes:
    """The new process in a killed rank's slot: its hello counts as its attempt_reconnect."""
    with connect(sock, world, rank, n) as comm:
        result = _summed(comm, seed, rank, 128, "i64")
        comm.barrier()
        return result


def through_a_daemon_death(sock: str, world: str, rank: int, n: int, seed: int) -> dict[str, Any]:
    """Wait in a barrier while a daemon of the world is killed; note how it ended; then
    attempt_reconnect until the world is back (the dead daemon restarts) and check a call."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n, timeout=10) as comm:
        comm.barrier()
        try:
            if rank == 0:
                comm.barrier()  # waits: rank 1 never comes
            else:
                while comm.is_healthy():  # rank 1 just watches
                    time.sleep(0.02)
                comm.barrier()  # raises what made it unhealthy
            out["error"] = None
        except Exception as exc:
            out["error"], out["message"] = type(exc).__name__, str(exc)
        out["at"] = time.time()
        out["errors"] = reconnect_until(comm, time.monotonic() + 30)  # until it is restarted
        out["epoch"] = comm.epoch
        out["result"] = _summed(comm, seed, rank, 64, "i32")
        out["rebuilt_at"] = time.time()
        comm.barrier()
    return out


def stop_and_go(sock: str, world: str, rank: int, n: int, timeout: float) -> dict[str, Any]:
    """Rank 0 waits in an all_reduce while rank 1 is frozen (SIGSTOP) past the deadline; after
    SIGCONT both rebuild the world."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n, timeout=timeout) as comm:
        buf = hostmem.alloc(64)
        settle_by = time.monotonic() + 30
        while True:  # (a loaded machine may keep a rank from its first call within the short timeout)
            try:
                comm.barrier()
                break
            except CommError:
                assert time.monotonic() < settle_by
                reconnect_until(comm, settle_by)
        out["first_epoch"] = comm.epoch
        if rank == 0:
            start = time.monotonic()
            try:
                comm.all_reduce(buf.ptr, 64)
                out["error"] = None
            except Exception as exc:
                out["error"] = type(exc).__name__
            out["seconds"] = time.monotonic() - start
            out["at"] = time.time()
        else:
            while comm.is_healthy():  # frozen in here by the test, and woken after the deadline
                time.sleep(0.02)
        reconnect_until(comm, time.monotonic() + 20)
        out["epoch"] = comm.epoch
        comm.all_reduce(buf.ptr, 64)
        out["rebuilt_at"] = time.time()
        comm.barrier()
    return out


def closed_by_a_signal_handler(sock: str, world: str, rank: int, n: int, daemon_pid: int,
                               reuse: bool = False) -> dict[str, Any]:
    """This process's SIGUSR1 handler closes its backend, as a service's SIGTERM handler
    would, while the main thread is inside a barrier's send: the daemon is stopped and the
    socket's send buffer full, so that the send blocks until the signal lands (unstopped, a
    signal lands there now and then: 5 runs in 12 of a barrier loop here). With `reuse`,
    the handler then opens pipes until one takes the socket's fd number, if it is free (as
    any other thread may). How the barrier ended and when, and the backend's state after."""
    with connect(sock, world, rank, n, timeout=10) as comm:
        comm.barrier()
        number = comm._conn.transport._sock.fileno()
        pipes: list[int] = []

        def close(signum: int, frame: object) -> None:
            comm.close()
            while reuse and number not in pipes and len(pipes) < 64:  # (the lowest free number first)
                pipes.extend(os.pipe())

        previous = signal.signal(signal.SIGUSR1, close)
        os.kill(daemon_pid, signal.SIGSTOP)
        try:
            # a copy of the socket fills it (without waiting: the flag, not the shared file's mode)
            with socket.socket(fileno=os.dup(comm._conn.transport._sock.fileno())) as filler:
                forget = proto.encode(proto.Forget(tuple(range(1, proto.MAX_GROUP_OPS + 1))))
                with contextlib.suppress(BlockingIOError):
                    while True:
                        filler.send(forget, socket.MSG_DONTWAIT)
            main = threading.main_thread().ident
            assert main is not None
            timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGUSR1))
            timer.start()
            started = time.monotonic()
            try:
                comm.barrier()
                ended = "returned"
            except CommError as exc:
                ended = f"{type(exc).__name__}: {exc}"
            took = time.monotonic() - started
            timer.join()
        finally:
            os.kill(daemon_pid, signal.SIGCONT)
            signal.signal(signal.SIGUSR1, previous)
            for fd in pipes:
                os.close(fd)
        return {"ended": ended, "took": took, "healthy": comm.is_healthy(),
                "next call": _error_name(comm.barrier)}


def across_a_stop(sock: str, world: str, rank: int, n: int, sender: int, nbytes: int, go: str,
                  seed: int) -> dict[str, Any]:
    """After a barrier, rank `sender` sends `nbytes` to the other rank (once the file `go`
    exists), which receives them, while a daemon stops; note how each call ended and what
    the receiver's buffer held; then attempt_reconnect until the world is back and check a call."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n, timeout=10) as comm:
        comm.barrier()
        buf = hostmem.alloc(nbytes)
        buf.view(np.uint8)[:] = rank + 1
        try:
            if rank == sender:
                while not os.path.exists(go):
                    time.sleep(0.01)
                comm.send_to(buf.ptr, nbytes, 1 - sender)
            else:
                comm.recv_from(buf.ptr, nbytes, sender)
            out["error"] = None
        except Exception as exc:
            out["error"], out["message"] = type(exc).__name__, str(exc)
        out["received"] = int(np.count_nonzero(buf.view(np.uint8) == sender + 1)) if rank != sender else 0
        out["errors"] = reconnect_until(comm, time.monotonic() + 30)  # until it is restarted
        out["epoch"] = comm.epoch
        out["result"] = _summed(comm, seed, rank, 64, "i32")
        comm.barrier()
    return out


def reconnect_through_a_stop(sock: str, world: str, rank: int, n: int, noted: str, back: str,
                             seed: int) -> dict[str, Any]:
    """After a barrier rank 1 leaves, and rank 0 waits in attempt_reconnect while the daemon
    stops; rank 0 notes how and when that ended (then touches `noted`) and calls
    attempt_reconnect until the world is back; rank 1 joins again once `back` exists. Both
    check a call."""
    out: dict[str, Any] = {}
    with connect(sock, world, rank, n, timeout=3) as comm:
        comm.barrier()
        if rank == 0:
            while comm.is_healthy():
                time.sleep(0.02)
            began = time.monotonic()
            try:
                comm.attempt_reconnect()
                out["error"] = None
            except Exception as exc:
                out["error"], out["message"] = type(exc).__name__, str(exc)
            out["took"] = time.monotonic() - began
            open(noted, "w").close()
            out["errors"] = reconnect_until(comm, time.monotonic() + 30)
            out["result"] = _summed(comm, seed, rank, 128, "i64")  # (what `replacement` calls)
            comm.barrier()
            return out
    while not os.path.exists(back):
        time.sleep(0.02)
    out["result"] = replacement(sock, world, rank, n, seed)
    return out


def reuse_after_a_stop(sock: str, world: str, rank: int, n: int, nbytes: int) -> tuple[str, int]:
    """all_reduce `nbytes` of f32 ones while the daemon stops; once the call failed, write
    the buffer at once, as a worker retrying its step would, then count what changed in it
    within half a second (the error's name, and that count)."""
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(nbytes)
        comm.barrier()
        view = buf.view(np.float32)
        view[:] = 1.0
        try:
            comm.all_reduce(buf.ptr, nbytes, dtype="f32")
            return ("no error", 0)
        except Exception as exc:
            view[:] = -7.0
            time.sleep(0.5)
            return (type(exc).__name__, int(np.count_nonzero(view != -7.0)))
