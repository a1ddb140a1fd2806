"""Seeded random programs of every call, for real ranks to run and numpy to check.

A program is a list of steps, the same for every rank. A step is one call, or a group
(group_start ... group_end) of several: collectives, and transfers (a send from one rank
and the receive at another, a rank to itself included), each rank making its share of
them in an order of its own (collectives in the common order, a pair's transfers in
theirs: what matching needs, nothing more). `generate` makes one from a seed, `run`
executes a rank's share in a worker process, `expected` says what every rank must hold.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import numpy as np

from client import DaemonBackend, hostmem
from tests.integration.data import NUMPY, grouped_reference, make_input

DTYPES = list(NUMPY)
OPS = ["sum", "prod", "min", "max"]
GUARD = 8  # bytes after every output span that no call may write
SENTINEL = 0xA5  # what output memory and guards hold before a call


@dataclass(frozen=True)
class Item:
    """One collective, or one transfer `src` -> `dst`."""

    kind: str  # all_reduce, all_reduce_async, all_gather, reduce_scatter, broadcast, command,
    # barrier, transfer
    nelem: int = 0  # elements (bytes for all_gather, broadcast and transfer); a rank's share
    # for reduce_scatter, its contribution for all_gather
    dtype: str = "u8"
    op: str = "sum"
    root: int = 0  # broadcast, command
    src: int = 0  # transfer
    dst: int = 0
    in_place: bool = False  # all_gather, reduce_scatter


@dataclass(frozen=True)
class Step:
    grouped: bool
    items: tuple[Item, ...]
    # per rank, its calls in its order: (item index, "send" / "recv" / "coll")
    orders: tuple[tuple[tuple[int, str], ...], ...]


def _count(rng: random.Random, big: int) -> int:
    """Elements: none, one, odd counts, and now and then more than the host engine runs
    on its loop (64 KiB) or `big`."""
    return rng.choice([0, 1, 3, rng.randrange(1, 200, 2), 1001, rng.randrange(1, 5000),
                       rng.randrange(1, 5000), 40_001 if rng.random() < 0.3 else 7, big])


def _collective(rng: random.Random, n: int, big: int) -> Item:
    kind = rng.choice(["all_reduce", "all_reduce_async", "all_gather", "reduce_scatter", "broadcast",
                       "command", "barrier"])
    dtype, op = rng.choice(DTYPES), rng.choice(OPS)
    count = _count(rng, big)
    if kind == "reduce_scatter":
        count = max(1, count // n) if count else 0
    return Item(kind, count, dtype, op, root=rng.randrange(n), in_place=rng.random() < 0.4)


def _transfer(rng: random.Random, n: int, big: int, src: int, dst: int) -> Item:
    return Item("transfer", _count(rng, big), src=src, dst=dst)


def _calls(item: Item, rank: int) -> list[str]:
    """The calls `rank` makes for `item`."""
    if item.kind != "transfer":
        return ["coll"]
    return (["send"] if item.src == rank else []) + (["recv"] if item.dst == rank else [])


def _orders(rng: random.Random, items: list[Item], n: int) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Each rank's calls in a random order that keeps its collectives, and each pair's
    transfers, in the items' order."""
    out = []
    for rank in range(n):
        streams: dict[object, list[tuple[int, str]]] = {}
        for i, item in enumerate(items):
            for role in _calls(item, rank):
                key = "coll" if role == "coll" else (role, item.src, item.dst)
                streams.setdefault(key, []).append((i, role))
        queues = list(streams.values())
        merged: list[tuple[int, str]] = []
        while queues:
            queue = rng.choice(queues)
            merged.append(queue.pop(0))
            if not queue:
                queues.remove(queue)
        out.append(tuple(merged))
    return tuple(out)


def generate(seed: int, n: int, steps: int = 24, big: int = 300_000) -> list[Step]:
    rng = random.Random(seed)
    program = []
    for _ in range(steps):
        shape = rng.random()
        if shape < 0.45:  # one collective, alone
            items = [_collective(rng, n, big)]
        elif shape < 0.55 and n > 1:  # one send and its receive, alone (no one else calls)
            src, dst = rng.sample(range(n), 2)
            items = [_transfer(rng, n, big, src, dst)]
        else:  # a group: collectives and transfers; now and then a ring both ways
            items = [_collective(rng, n, big) for _ in range(rng.randrange(3))]
            if rng.random() < 0.3:
                items += [_transfer(rng, n, big, r, (r + d) % n) for d in (1, -1) for r in range(n)]
            for _ in range(rng.randrange(4)):
                src = rng.randrange(n)
                dst = src if rng.random() < 0.15 else rng.randrange(n)
                items.append(_transfer(rng, n, big, src, dst))
            rng.shuffle(items)
        # (a group may be empty; a send to oneself alone would wait for its own receive)
        grouped = len(items) != 1 or (items[0].kind == "transfer" and items[0].src == items[0].dst) \
            or rng.random() < 0.2
        program.append(Step(grouped, tuple(items), _orders(rng, items, n)))
    return program


def _seed(program_seed: int, step: int, item: int) -> int:
    return program_seed * 1_000_000 + step * 100 + item


def command_word(seed: int) -> int:
    return (seed * 2654435761 + 12345) % (1 << 32)


def _input(item: Item, seed: int, rank: int, n: int) -> np.ndarray:
    """What `rank` puts in for `item` (a transfer: what its sender sends)."""
    if item.kind in ("all_reduce", "all_reduce_async"):
        return make_input(seed, rank, item.nelem, item.dtype, item.op)
    if item.kind == "reduce_scatter":
        return make_input(seed, rank, item.nelem * n, item.dtype, item.op)
    if item.kind == "command":
        return np.array([command_word(seed)], np.uint32)
    if item.kind == "transfer":
        return make_input(seed, item.src, item.nelem, "u8", "sum")
    return make_input(seed, rank, item.nelem, "u8", "sum")


def expected(program: list[Step], program_seed: int, n: int,
             groups: list[list[int]]) -> list[list[tuple[int, int, str, bytes]]]:
    """Per rank: (step, item, call, the bytes its output span holds after the step)."""
    out: list[list[tuple[int, int, str, bytes]]] = [[] for _ in range(n)]
    for s, step in enumerate(program):
        for rank in range(n):
            for i, role in step.orders[rank]:
                item, seed = step.items[i], _seed(program_seed, s, i)
                if role == "send":
                    continue
                inputs = [_input(item, seed, r, n) for r in range(n)]
                kind = item.kind
                if kind in ("all_reduce", "all_reduce_async"):
                    want = grouped_reference(inputs, item.dtype, item.op, groups).tobytes()
                elif kind == "reduce_scatter":
                    full = grouped_reference(inputs, item.dtype, item.op, groups)
                    share = slice(rank * item.nelem, (rank + 1) * item.nelem)
                    if item.in_place:
                        whole = inputs[rank].copy()
                        whole[share] = full[share]
                        want = whole.tobytes()
                    else:
                        want = full[share].tobytes()
                elif kind == "all_gather":
                    want = b"".join(x.tobytes() for x in inputs)
                elif kind in ("broadcast", "command"):
                    want = inputs[item.root].tobytes()
                elif kind == "barrier":
                    want = b""
                else:
                    want = inputs[rank].tobytes()
                out[rank].append((s, i, role, want + bytes([SENTINEL]) * GUARD))
    return out


class _Arena:
    """One buffer a rank carves its spans from, at random offsets (whole elements), each
    followed by a guard; carved again from its start each step (the daemon maps it once)."""

    def __init__(self, nbytes: int, rng: random.Random) -> None:
        self.buf = hostmem.alloc(nbytes)
        self.bytes = self.buf.view(np.uint8)
        self.rng = rng
        self.used = 0

    def take(self, nbytes: int, itemsize: int) -> int:
        """A span's offset; the span and its guard hold the sentinel."""
        gap = itemsize * self.rng.randrange(4)
        start = -(-(self.used + gap) // itemsize) * itemsize
        self.used = start + nbytes + GUARD
        assert self.used <= len(self.bytes), "the arena is too small for the program"
        self.bytes[start:self.used] = SENTINEL
        return start


def _span_bytes(item: Item, n: int) -> int:
    """At least what an item's spans, gaps and guards take."""
    return 2 * (item.nelem * np.dtype(NUMPY[item.dtype]).itemsize * (n + 1) + GUARD + 4 * 8)


def arena_bytes(program: list[Step], n: int) -> int:
    """Enough for the biggest step's spans."""
    return max([sum(_span_bytes(item, n) for item in step.items) for step in program], default=0) + 64


def fingerprint(item: Item, n: int) -> tuple[object, ...]:
    """What matched calls must agree on, in the items' terms."""
    itemsize = np.dtype(NUMPY[item.dtype]).itemsize
    if item.kind in ("all_reduce", "all_reduce_async", "reduce_scatter"):
        return (item.kind.removesuffix("_async"), item.nelem * itemsize, item.dtype, item.op)
    if item.kind in ("broadcast", "command"):
        return ("broadcast", 4 if item.kind == "command" else item.nelem, item.root)
    return (item.kind, 0 if item.kind == "barrier" else item.nelem)


def changed(rng: random.Random, item: Item, n: int, rank: int) -> Item:
    """`item` as `rank` calls it with one thing its partners' calls disagree with."""
    while True:
        choice = rng.randrange(4)
        if choice == 0 and item.kind != "transfer":
            new = replace(_collective(rng, n, 1000), in_place=False)
        elif choice == 1:
            new = replace(item, nelem=item.nelem + rng.choice([1, 2, 999]))
        elif choice == 2 and item.kind in ("all_reduce", "all_reduce_async", "reduce_scatter"):
            new = replace(item, dtype=rng.choice(DTYPES), op=rng.choice(OPS))
        elif choice == 3 and item.kind == "broadcast" and n > 1:
            new = replace(item, root=rng.choice([r for r in range(n) if r != item.root]))
        else:
            continue
        if new.kind == "command" and new.root == rank:  # (refused by the client: not a call)
            continue
        if fingerprint(new, n) != fingerprint(item, n):
            return new


Change = tuple[int, int, int, Item]  # (step, rank, item index, the item as that rank calls it)


def run(sock: str, world: str, rank: int, n: int, program_seed: int,
        program: list[Step], change: Change | None = None) -> list[tuple[int, int, str, bytes]]:
    """Rank `rank`'s share of the program (in a worker); what `expected` describes.
    `change`: one call of one rank that disagrees with its partners'."""
    from tests.integration.workers import connect

    with connect(sock, world, rank, n) as comm:
        results = execute(comm, rank, n, program_seed, program, change)
        comm.barrier()  # our last call may finish before the others': leaving would fail the world
    return results


def run_after_mismatch(sock: str, world: str, rank: int, n: int, program_seed: int, program: list[Step],
                       change: Change, then: list[Step]) -> tuple[str, list[tuple[int, int, str, bytes]]]:
    """`program` with `change` (its error: class, code, text), attempt_reconnect, then
    `then` (seeded program_seed + 1) in the rebuilt world: what `expected` says of it."""
    from client import MismatchError
    from tests.integration.workers import connect, reconnect_until

    with connect(sock, world, rank, n) as comm:
        try:
            execute(comm, rank, n, program_seed, program, change)
            comm.barrier()  # (a rank whose calls all matched before the mismatch hears of it here)
            error = "no error"
        except MismatchError as exc:
            error = f"MismatchError ({exc.code.value}): {exc}"
        reconnect_until(comm, time.monotonic() + 30)
        results = execute(comm, rank, n, program_seed + 1, then)
        comm.barrier()
    return error, results


def execute(comm: DaemonBackend, rank: int, n: int, program_seed: int, program: list[Step],
            change: Change | None = None) -> list[tuple[int, int, str, bytes]]:
    rng = random.Random(f"{program_seed}/{rank}")  # this rank's own layout
    results = []
    extra = _span_bytes(change[3], n) if change is not None else 0
    arena = _Arena(arena_bytes(program, n) + extra, rng)
    base = arena.buf.ptr
    for s, step in enumerate(program):
        arena.used = 0
        reads: list[tuple[int, str, int, int]] = []  # item, call, offset, bytes
        if step.grouped:
            comm.group_start()
        for i, role in step.orders[rank]:
            item, seed = step.items[i], _seed(program_seed, s, i)
            if change is not None and change[:3] == (s, rank, i):
                item = change[3]
            data = _input(item, seed, rank, n).view(np.uint8)
            itemsize = np.dtype(NUMPY[item.dtype]).itemsize
            kind, size = item.kind, data.nbytes
            if kind in ("all_reduce", "all_reduce_async"):
                at = arena.take(size, itemsize)
                arena.bytes[at:at + size] = data
                if kind == "all_reduce":
                    comm.all_reduce(base + at, size, dtype=item.dtype, op=item.op)
                else:
                    comm.all_reduce_async(base + at, size, 0, dtype=item.dtype, op=item.op)
                reads.append((i, role, at, size))
            elif kind == "all_gather":
                recv = arena.take(size * n, 1)
                send = recv + rank * size if item.in_place else arena.take(size, 1)
                arena.bytes[send:send + size] = data
                comm.all_gather(base + send, base + recv, size)
                reads.append((i, role, recv, size * n))
            elif kind == "reduce_scatter":
                share = size // n
                send = arena.take(size, itemsize)
                recv = send + rank * share if item.in_place else arena.take(share, itemsize)
                arena.bytes[send:send + size] = data
                comm.reduce_scatter(base + send, base + recv, share, dtype=item.dtype, op=item.op)
                # (in place: the whole buffer, the other shares as they were)
                reads.append((i, role, send, size) if item.in_place else (i, role, recv, share))
            elif kind in ("broadcast", "command"):
                at = arena.take(size, itemsize)
                if rank == item.root:
                    arena.bytes[at:at + size] = data
                # (a non-root may take a command with a 4-byte broadcast too: the same collective)
                if kind == "command" and rank != item.root and (program_seed + s + rank) % 3:
                    comm.recv_command_u32(base + at, item.root)
                else:
                    comm.broadcast(base + at, size, item.root)
                reads.append((i, role, at, size))
            elif kind == "barrier":
                comm.barrier()
                reads.append((i, role, arena.take(0, 1), 0))
            elif role == "send":
                at = arena.take(size, 1)
                arena.bytes[at:at + size] = data
                comm.send_to(base + at, size, item.dst)
            else:
                at = arena.take(size, 1)
                comm.recv_from(base + at, size, item.src)
                reads.append((i, role, at, size))
        if step.grouped:
            comm.group_end()
        for i, role, at, size in reads:
            results.append((s, i, role, bytes(arena.bytes[at:at + size + GUARD])))
    return results
