"""Randomized chaos soak of the whole product: real daemons, real worker processes, faults.

    .venv/bin/python scripts/soak.py --duration 300 --daemons 1
    .venv/bin/python scripts/soak.py --duration 300 --daemons 2 --proxy
    .venv/bin/python scripts/soak.py --duration 300 --daemons 3 --seed 7 --keep

A tool, not part of the test suite: it looks for the rare races the deterministic tests
miss, and prints (and writes as JSON to <dir>/report.json) what it saw. Exit status 0: no
anomaly; 1: at least one.

What runs. `--daemons` host-engine daemons (with more than one: peer listeners, a shared
secret, a 0.2 s heartbeat and a 1 s window), and worlds of real worker processes
(`--worlds`, default two worlds of 4 and 3 ranks placed over the daemons; the daemon of
rank 0 is a world's root, and a rank's bootstrap is `socket@root_peer_address`). Every
worker runs the same schedule as the other ranks of its world: step s is drawn from a
random generator seeded by (seed, world, s), so every rank makes the same call with the
same sizes, dtypes, ops, roots and pairs: all_reduce (every dtype and op, sync or async,
on a kept hostmem buffer at an offset, a fresh one freed afterwards, a registered span, or
symmetric_alloc memory kept for the whole run), all_gather, reduce_scatter, broadcast,
barrier, send/recv in groups (a random permutation), ungrouped send/recv between two ranks,
recv_command_u32 from rank 0, register/deregister, symmetric_alloc/free, and an all_reduce
(up to 4 MiB, on a kept buffer) in one group with a send/recv permutation (each rank
orders its group's calls as it likes). Inputs are
`tests/integration/data.make_input` of (step, rank); each result is checked byte for byte
against numpy (`grouped_reference`: the documented order across daemons). Which buffer a
rank uses is its own random choice.

On an error a worker recovers as a real one would: `attempt_reconnect` until it succeeds
(`tests/integration/workers.reconnect_until`'s loop), then the ranks agree on where to go
on (an i64 max all_reduce of each rank's next step) and go on from there.

Chaos. A thread injects, at random intervals (`--gap`), one of `--faults`:
  kill-worker   kill -9 a worker; a replacement process takes its rank
  stop-worker   SIGSTOP a worker for 0.2-2.5 x the call timeout, then SIGCONT
  kill-daemon   kill -9 a daemon (with several: the root of a world or a member) and
                restart it on the same socket and peer port
  stop-daemon   SIGSTOP a daemon (a root or a member) for 0.2-2.5 x the call timeout, then
                SIGCONT: a stalled host (its peers' links go silent past the window, its
                own ranks' calls reach their deadline with no answer)
  term-daemon   SIGTERM a daemon (a root or a member), which must exit 0 within 5 s +
                `--slack`, then restart it as kill-daemon does: its own ranks get
                DaemonShutdown, the other daemons' ranks PeerLost
  net           (with --proxy: each member daemon reaches each root through
                tests/integration/faultproxy.py) cut, black-hole or half-open a member's
                link to a root for 0.3-2.5 x the peer window, then heal
When `--duration` ends the chaos stops, every stopped process is resumed and the network
healed; the workers agree to stop (a control step every 8 steps), end with a barrier and
report.

What must hold (each breach is an anomaly, listed in the report):
  wrong         a call that returned with a result different from numpy's: zero, ever
  late-write    a call that failed (any CommError) hands its host buffers back to the worker
                (README, Deadlines and Stopping): the worker writes a sentinel into each at
                once and reads it back 0.05-0.3 s later, before it reuses them; a byte that
                changed meanwhile was written by an op the failure did not stop: zero, ever
  untyped       an exception that is not a CommError subclass: zero
  hang          a call that did not return within its bound (the call timeout + 2 s for the
                daemon's verdict + `--slack`; a reconnect twice that; recv_command_u32, which
                has no deadline, also the longest stop), not counting time this worker
                itself spent stopped (its watchdog sees the gap): zero; all threads' stacks
                go to the worker's log
  unexpected    a typed error no fault explains: MisuseError, ProtocolError, LimitExceeded,
                DaemonInternalError, AccessDenied
  crash         a worker that died without being killed, or did not finish in time
  leak          a daemon that, once every worker is gone, holds other than it did at rest
                before the run (fds, peer TCP links aside, and memfd mappings)
  daemon        a daemon that chaos did not kill is not alive or does not answer
                `commd status`; a daemon's log with a traceback
  stop          a daemon that term-daemon stopped did not exit 0 within its bound (then
                it is killed, and restarted all the same)
Progress (steps done per world, errors by class, reconnects) is reported too.

Everything (daemon logs, each worker's event log) is under a fresh /tmp directory,
removed at the end unless --keep or an anomaly.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

SECRET = "soak-secret-0123456789abcdef"
DTYPES = ("bf16", "f16", "f32", "f64", "i32", "i64", "u8")
OPS = ("sum", "prod", "min", "max")
CTL_EVERY = 8  # every 8th step the ranks agree whether to stop
SUSPICIOUS = ("MisuseError", "ProtocolError", "LimitExceeded", "DaemonInternalError", "AccessDenied")
SENTINEL = bytes.fromhex("a55ac33cdeadbeef")  # what a failed call's buffers hold while the worker waits
STOP_BOUND_S = 5.0  # a stopping daemon's exit: its links' 1 s to flush, and startup's imports to spare
KINDS = {"ar": 30, "ar_async": 8, "ag": 8, "rs": 8, "bc": 8, "barrier": 4, "p2p_group": 8,
         "p2p_pair": 6, "cmd": 8, "reg": 5, "sym": 4}
# Kinds added later, by weight beside KINDS'. Each takes its share of the steps by a draw of
# its own, not by a longer KINDS: that would rescale the one draw and change the kind of
# four steps in ten, so a seed's old schedule (and its reports) would not replay.
ADDED_KINDS = {"coll_group": 6}
COLL_GROUP_BYTES = 4 << 20  # large enough that the engine is still running it when a fault lands


# ---------------------------------------------------------------------------------------
# the worker side


@dataclass
class WorkerSpec:
    world: str
    rank: int
    n: int
    sock: str  # path@bootstrap, or a path
    groups: list[list[int]]  # the world's ranks by daemon (for the float reference)
    timeout: float
    seed: int
    log: str
    stopfile: str
    slack: float
    max_stop: float
    max_bytes: int
    generation: int
    side: bool


@dataclass
class _Timed:
    what: str
    start: float
    bound: float
    credit: float = 0.0  # seconds this process was not running meanwhile
    told: bool = False


class Watchdog:
    """Times each call against its bound. Time this process spent stopped (SIGSTOP, or the
    machine not running it) shows as a gap between its ticks and is not held against the
    call."""

    def __init__(self, event: Callable[..., None]) -> None:
        self._event = event
        self._lock = threading.Lock()
        self._current: dict[str, _Timed] = {}  # by thread
        self.max_over = -1e9  # the longest call's time past its bound (negative: within)
        threading.Thread(target=self._run, daemon=True, name="watchdog").start()

    @contextlib.contextmanager
    def call(self, what: str, bound: float, thread: str = "main") -> Iterator[None]:
        entry = _Timed(what, time.monotonic(), bound)
        with self._lock:
            self._current[thread] = entry
        try:
            yield
        finally:
            with self._lock:
                del self._current[thread]
            over = time.monotonic() - entry.start - entry.credit - bound
            self.max_over = max(self.max_over, over)
            if entry.told:
                self._event("hang_ended", what=what, took=round(time.monotonic() - entry.start, 2),
                            credit=round(entry.credit, 2))

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            gap, last = now - last - 0.1, now
            with self._lock:
                late = []
                for entry in self._current.values():
                    if gap > 0.3:
                        entry.credit += gap
                    if now - entry.start - entry.credit > entry.bound and not entry.told:
                        entry.told = True
                        late.append(entry)
            for entry in late:
                self._event("hang", what=entry.what, bound=entry.bound, credit=round(entry.credit, 2))
                self._event("stacks", text=_stacks())


def _stacks() -> str:
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        return out.read()


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        from client import hostmem

        self.s = spec
        self.logf = open(spec.log, "a", buffering=1)  # noqa: SIM115 - the process's lifetime
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.anomalies: Counter[str] = Counter()
        self.watch = Watchdog(self.event)
        self.comm: Any = None
        self.next_step = 0
        self.agreed_epoch = -1
        self.recovering = threading.Event()  # the main thread is in recover()
        self.group_open = False
        self.stop_agreed = False
        # kept for the whole run: imported once, and again into a restarted daemon
        self.kept = [hostmem.alloc(spec.max_bytes + 8192) for _ in range(2)]
        self.sym_ptr: int | None = None
        self.sym_bytes = 1 << 20
        self.handles: list[tuple[int, int, int]] = []  # (handle, kept buffer index, offset)
        self.ctl = hostmem.alloc(32)
        self.ctl_span = (self.ctl.ptr, self.ctl.view(np.uint8))
        # (not the schedule's: how long a failed call's buffers are watched is the rank's own)
        self.late_rng = random.Random(f"late:{spec.seed}:{spec.world}:{spec.rank}:{spec.generation}")
        self.last_progress = 0.0
        self.started = time.monotonic()

    # ---- reporting

    def event(self, kind: str, **info: Any) -> None:
        info.update(kind=kind, t=round(time.time(), 3), world=self.s.world, rank=self.s.rank,
                    gen=self.s.generation)
        self.logf.write(json.dumps(info, default=str) + "\n")

    def anomaly(self, kind: str, **info: Any) -> None:
        self.anomalies[kind] += 1
        self.event(kind, **info)

    def progress(self, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last_progress > 2:
            self.last_progress = now
            self.event("final" if final else "progress", steps=self.next_step, counts=dict(self.counts),
                       errors=dict(self.errors), anomalies=dict(self.anomalies),
                       max_over=round(self.watch.max_over, 3))

    # ---- bounds

    @property
    def call_bound(self) -> float:
        return self.s.timeout + 2.0 + self.s.slack

    @property
    def join_bound(self) -> float:
        import proto

        return 2 * self.s.timeout + 2 * (proto.JOIN_BACKSTOP_S + 1.0) + self.s.slack

    # ---- the loop

    def run(self) -> None:
        try:
            self.join()
            try:
                self.agree()
            except Exception as exc:
                self.failed(exc, "agree")
                self.recover()
            side = threading.Thread(target=self.side, daemon=True, name="side")
            if self.s.side:
                side.start()
            while not self.stop_agreed:
                try:
                    if self.comm.epoch != self.agreed_epoch:  # the side thread rebuilt the world
                        self.agree()
                    self.step(self.next_step)
                    self.next_step += 1
                except Exception as exc:
                    self.failed(exc, f"step {self.next_step}")
                    self.recover()
                self.progress()
            if side.is_alive():  # (it ends after its call: then the backend may close)
                side.join(self.join_bound)
            self.progress(final=True)
        except BaseException as exc:  # (nothing should get here: told, then the process fails)
            self.anomaly("untyped", where="run", error=repr(exc), tb=traceback.format_exc())
            self.progress(final=True)
            raise

    def failed(self, exc: BaseException, where: str) -> None:
        from client import CommError

        name = type(exc).__name__
        if not isinstance(exc, CommError):
            self.anomaly("untyped", where=where, error=repr(exc), tb=traceback.format_exc())
            return
        self.errors[name] += 1
        if name in SUSPICIOUS and not (name == "MisuseError" and "reconnect ended this thread's group"
                                       in str(exc) and self.group_open):
            self.anomaly("unexpected", where=where, error=name, message=str(exc))
        self.event("error", where=where, error=name, message=str(exc)[:300])

    def join(self) -> None:
        from client import DaemonBackend

        path, _, bootstrap = self.s.sock.partition("@")
        while True:
            try:
                with self.watch.call("join", self.join_bound):
                    self.comm = DaemonBackend(path, self.s.world, self.s.rank, self.s.n,
                                              timeout=self.s.timeout, bootstrap=bootstrap or None)
                self.counts["joins"] += 1
                return
            except Exception as exc:
                self.failed(exc, "join")
                time.sleep(0.2)

    def recover(self) -> None:
        """attempt_reconnect until it works, then agree on the step to go on from."""
        self.recovering.set()
        try:
            self._recover()
        finally:
            self.recovering.clear()

    def _recover(self) -> None:
        from client import MisuseError

        while True:
            try:
                with self.watch.call("attempt_reconnect", self.join_bound):
                    self.comm.attempt_reconnect()
                self.counts["reconnects"] += 1
            except Exception as exc:
                self.failed(exc, "attempt_reconnect")
                time.sleep(0.2)
                continue
            if self.group_open:  # the reconnect ended it: refused once, at group_end
                self.group_open = False
                try:
                    self.comm.group_end()
                    self.anomaly("unexpected", where="group_end after reconnect",
                                 error="no error (a dropped group must be refused once)")
                except MisuseError:
                    pass
                except Exception as exc:
                    self.failed(exc, "group_end after reconnect")
                    continue
            try:
                self.agree()
                return
            except Exception as exc:
                self.failed(exc, "agree")

    def agree(self) -> None:
        """The ranks go on from the furthest step any of them reached (a step done by some
        ranks only is not done again)."""
        # (24 bytes: never paired with a control step's 16 by mistake, which would be ours)
        words = self.ctl.view(np.int64)
        words[:3] = [self.next_step, 0, 0x5EED]
        epoch = self.comm.epoch  # (a rebuild after this refuses the call: stale)
        with self.kept_on_failure("agree", self.ctl_span), self.watch.call("agree", self.call_bound):
            self.comm.all_reduce(self.ctl.ptr, 24, dtype="i64", op="max")
        if int(words[0]) < self.next_step or words[1:3].tolist() != [0, 0x5EED]:
            self.anomaly("wrong", what="agree", got=words[:3].tolist(), mine=self.next_step)
        self.next_step = max(self.next_step, int(words[0]))
        self.agreed_epoch = epoch

    def side(self) -> None:
        """A second thread of the rank: registrations, symmetric memory and host buffers of
        its own, while the main thread calls; on a failure it too calls attempt_reconnect
        (the rank is rebuilt once, whichever thread comes first)."""
        from client import hostmem
        from client.errors import UNHEALTHY

        rng = random.Random(f"side:{self.s.seed}:{self.s.world}:{self.s.rank}:{self.s.generation}")
        buf = hostmem.alloc(1 << 16)
        handles: list[int] = []
        while not self.stop_agreed:
            time.sleep(rng.uniform(0, 0.05))
            what = rng.choice(["register", "deregister", "symmetric", "healthy", "hostmem"])
            try:
                with self.watch.call("side " + what, self.call_bound, thread="side"):
                    if what == "register" and len(handles) < 8:
                        offset = rng.randrange(1 << 15)
                        handles.append(self.comm.register_buffer(buf.ptr + offset, rng.randint(1, 1 << 15)))
                    elif what == "deregister" and handles:
                        self.comm.deregister_buffer(handles.pop(rng.randrange(len(handles))))
                    elif what == "symmetric":
                        ptr = self.comm.symmetric_alloc(rng.randint(1, 1 << 16))
                        self.comm.symmetric_free(ptr)
                    elif what == "healthy":
                        self.comm.is_healthy()
                    elif what == "hostmem":
                        hostmem.alloc(rng.randint(1, 1 << 16)).close()
                self.counts["side_" + what] += 1
            except Exception as exc:
                self.failed(exc, "side " + what)
                # with the main thread, which met the failure too (alone, the rebuild could
                # come between the main thread's calls: its next would be the new world's
                # first, while the other ranks agree on where to go on)
                if isinstance(exc, UNHEALTHY) and self.recovering.wait(2 * self.s.timeout):
                    try:
                        with self.watch.call("side attempt_reconnect", self.join_bound, thread="side"):
                            self.comm.attempt_reconnect()
                        self.counts["side_reconnects"] += 1
                    except Exception as again:
                        self.failed(again, "side attempt_reconnect")
                        time.sleep(0.2)

    # ---- the schedule

    def schedule(self, step: int) -> random.Random:
        return random.Random(f"{self.s.seed}:{self.s.world}:{step}")

    def local(self, step: int) -> random.Random:
        return random.Random(f"{self.s.seed}:{self.s.world}:{step}:{self.s.rank}:{self.s.generation}")

    def step(self, step: int) -> None:
        if step % CTL_EVERY == 0:
            return self.control()
        rng = self.schedule(step)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        added = random.Random(f"{self.s.seed}:{self.s.world}:{step}:added")
        roll = added.random() * (sum(KINDS.values()) + sum(ADDED_KINDS.values()))
        for name, weight in ADDED_KINDS.items():
            if roll < weight:
                kind = name
                break
            roll -= weight
        getattr(self, "do_" + kind)(step, rng, self.local(step))
        self.counts[kind] += 1

    def control(self) -> None:
        words = self.ctl.view(np.int64)
        words[:2] = [1 if os.path.exists(self.s.stopfile) else 0, self.s.rank]
        with self.kept_on_failure("ctl", self.ctl_span), self.watch.call("ctl", self.call_bound):
            self.comm.all_reduce(self.ctl.ptr, 16, dtype="i64", op="max")
        if words[1] != self.s.n - 1 or words[0] not in (0, 1):
            self.anomaly("wrong", what="ctl", got=words[:2].tolist())
        if words[0] == 1:
            with self.watch.call("final barrier", self.call_bound):
                self.comm.barrier()
            self.stop_agreed = True

    def size(self, rng: random.Random, itemsize: int, parts: int = 1) -> int:
        """Elements: mostly small, sometimes across a 4 MiB chunk (within --max-bytes)."""
        roll = rng.random()
        top = self.s.max_bytes // itemsize // parts
        if roll < 0.05:
            return 0
        if roll < 0.75:
            return rng.randint(1, min(top, 2048))
        if roll < 0.96:
            return rng.randint(1, min(top, 64 * 1024))
        return rng.randint(1, top)

    @contextlib.contextmanager
    def span(self, nbytes: int, local: random.Random, allow_sym: bool = True,
             slot: int | None = None) -> Iterator[tuple[int, Any]]:
        """A pointer to `nbytes` of memory the call may use, and a numpy byte view of it:
        a kept buffer at an offset (kept[slot]: a call's two spans never overlap), a fresh
        buffer (freed after), or the symmetric one."""
        from client import hostmem

        roll = local.random()
        if allow_sym and roll < 0.15 and nbytes <= self.sym_bytes:
            ptr = self.symmetric()
            if ptr is not None:
                import ctypes

                view = np.ctypeslib.as_array((ctypes.c_uint8 * self.sym_bytes).from_address(ptr))
                yield ptr, view[:nbytes]
                return
        if roll < 0.35:
            # (not closed: the caller's views hold it until they go; then its finalizer tells
            # the daemon to forget it)
            fresh = hostmem.alloc(max(nbytes, 1))
            yield fresh.ptr, fresh.view(np.uint8)[:nbytes]
            return
        buf = self.kept[slot] if slot is not None else local.choice(self.kept)
        offset = 8 * local.randint(0, 1024)
        yield buf.ptr + offset, buf.view(np.uint8)[offset:offset + nbytes]

    def symmetric(self) -> int | None:
        if self.sym_ptr is None:
            with self.watch.call("symmetric_alloc", self.call_bound):
                self.sym_ptr = self.comm.symmetric_alloc(self.sym_bytes)
        return self.sym_ptr

    @contextlib.contextmanager
    def kept_on_failure(self, call: str, *spans: tuple[int, Any], **info: Any) -> Iterator[None]:
        """If the call fails, its host buffers (`spans`: pointer, byte view) are the
        worker's at once: a sentinel written into them then must still be there when the
        worker would reuse them. (Symmetric memory is the daemon's: not watched.)"""
        from client import CommError

        try:
            yield
        except CommError as exc:
            views = [view for ptr, view in spans if ptr != self.sym_ptr and len(view)]
            for view in views:
                view[:] = _sentinel(len(view))
            waited = self.late_rng.uniform(0.05, 0.3)
            time.sleep(waited)
            changed = [int(np.count_nonzero(view != _sentinel(len(view)))) for view in views]
            self.counts["late_checked"] += bool(views)
            if any(changed):
                self.anomaly("late-write", call=call, error=type(exc).__name__, message=str(exc)[:300],
                             changed_bytes=changed, of_bytes=[len(v) for v in views],
                             waited=round(waited, 3), **info)
            raise

    def check(self, what: str, got: Any, want: bytes, **info: Any) -> None:
        raw = bytes(got)
        if raw == want:
            self.counts["checked"] += 1
            return
        common = min(len(raw), len(want))
        mism = next((i for i in range(common) if raw[i] != want[i]), common)
        self.anomaly("wrong", what=what, call=info, want_len=len(want), got_len=len(raw),
                     first_diff_byte=mism, got=raw[mism:mism + 16].hex(), want=want[mism:mism + 16].hex())

    def inputs(self, step: int, nelem: int, dtype: str, op: str) -> list[Any]:
        from tests.integration.data import make_input

        return [make_input(step, r, nelem, dtype, op) for r in range(self.s.n)]

    def reduced(self, inputs: list[Any], dtype: str, op: str) -> Any:
        from tests.integration.data import grouped_reference

        return grouped_reference(inputs, dtype, op, self.s.groups)

    def do_ar(self, step: int, rng: random.Random, local: random.Random, use_async: bool = False) -> None:
        dtype, op = rng.choice(DTYPES), rng.choice(OPS)
        itemsize = np.dtype(_numpy(dtype)).itemsize
        nelem = self.size(rng, itemsize)
        if (dtype, op) == ("i64", "max") and nelem in (2, 3):
            nelem = 4  # (never the control step's or the agreement's call, paired by mistake)
        inputs = self.inputs(step, nelem, dtype, op)
        mine = inputs[self.s.rank]
        with self.span(mine.nbytes, local) as (ptr, view):
            view[:] = mine.view(np.uint8)
            what = "all_reduce_async" if use_async else "all_reduce"
            with self.kept_on_failure(what, (ptr, view), step=step), self.watch.call(what, self.call_bound):
                if use_async:
                    self.comm.all_reduce_async(ptr, mine.nbytes, 0, dtype=dtype, op=op)
                else:
                    self.comm.all_reduce(ptr, mine.nbytes, dtype=dtype, op=op)
            self.check("all_reduce", view, self.reduced(inputs, dtype, op).tobytes(), step=step,
                       dtype=dtype, op=op, nelem=nelem, use_async=use_async)

    def do_ar_async(self, step: int, rng: random.Random, local: random.Random) -> None:
        self.do_ar(step, rng, local, use_async=True)

    def do_ag(self, step: int, rng: random.Random, local: random.Random) -> None:
        nbytes = self.size(rng, 1, self.s.n)
        inputs = self.inputs(step, nbytes, "u8", "sum")
        with self.span(nbytes, local, allow_sym=False, slot=0) as (sptr, sview), \
                self.span(nbytes * self.s.n, local, allow_sym=False, slot=1) as (rptr, rview):
            sview[:] = inputs[self.s.rank]
            rview[:] = 0xEE
            with self.kept_on_failure("all_gather", (sptr, sview), (rptr, rview), step=step), \
                    self.watch.call("all_gather", self.call_bound):
                self.comm.all_gather(sptr, rptr, nbytes)
            self.check("all_gather", rview, b"".join(x.tobytes() for x in inputs), step=step, nbytes=nbytes)

    def do_rs(self, step: int, rng: random.Random, local: random.Random) -> None:
        dtype, op = rng.choice(DTYPES), rng.choice(OPS)
        itemsize = np.dtype(_numpy(dtype)).itemsize
        share = self.size(rng, itemsize, self.s.n)
        inputs = self.inputs(step, share * self.s.n, dtype, op)
        nbytes = share * itemsize
        with self.span(nbytes * self.s.n, local, allow_sym=False, slot=0) as (sptr, sview), \
                self.span(nbytes, local, allow_sym=False, slot=1) as (rptr, rview):
            sview[:] = inputs[self.s.rank].view(np.uint8)
            with self.kept_on_failure("reduce_scatter", (sptr, sview), (rptr, rview), step=step), \
                    self.watch.call("reduce_scatter", self.call_bound):
                self.comm.reduce_scatter(sptr, rptr, nbytes, dtype=dtype, op=op)
            full = self.reduced(inputs, dtype, op).view(np.uint8)
            mine = full[self.s.rank * nbytes:(self.s.rank + 1) * nbytes]
            self.check("reduce_scatter", rview, mine.tobytes(), step=step, dtype=dtype, op=op, share=share)

    def do_bc(self, step: int, rng: random.Random, local: random.Random) -> None:
        root = rng.randrange(self.s.n)
        nbytes = self.size(rng, 1)
        inputs = self.inputs(step, nbytes, "u8", "sum")
        with self.span(nbytes, local) as (ptr, view):
            view[:] = inputs[self.s.rank]
            with self.kept_on_failure("broadcast", (ptr, view), step=step), \
                    self.watch.call("broadcast", self.call_bound):
                self.comm.broadcast(ptr, nbytes, root)
            self.check("broadcast", view, inputs[root].tobytes(), step=step, root=root, nbytes=nbytes)

    def do_barrier(self, step: int, rng: random.Random, local: random.Random) -> None:
        with self.watch.call("barrier", self.call_bound):
            self.comm.barrier()

    def message(self, step: int, src: int, dst: int, nbytes: int) -> Any:
        from tests.integration.data import make_input

        return make_input(step * 1000 + src * 31 + dst, 0, nbytes, "u8", "sum")

    def exchange(self, step: int, rng: random.Random) -> tuple[list[Callable[[], None]],
                                                                list[tuple[int, Any]], Callable[[], None]]:
        """Rank r sends to perm[r] (if not itself), all in one group: this rank's calls (the
        group's to make), their host buffers, and the check of what it received."""
        perm = list(range(self.s.n))
        rng.shuffle(perm)
        sizes = [self.size(rng, 1) for _ in range(self.s.n)]  # by sender
        me = self.s.rank
        src = perm.index(me)
        dst = perm[me]
        from client import hostmem

        out = hostmem.alloc(max(sizes[me], 1))
        into = hostmem.alloc(max(sizes[src], 1))
        out.view(np.uint8)[:sizes[me]] = self.message(step, me, dst, sizes[me])
        into.view(np.uint8)[:] = 0xEE
        calls: list[Callable[[], None]] = []
        if dst != me:
            calls.append(lambda: self.comm.send_to(out.ptr, sizes[me], dst, 0))
        if src != me:
            calls.append(lambda: self.comm.recv_from(into.ptr, sizes[src], src, 0))

        def verify() -> None:
            if src != me:
                self.check("recv in group", into.view(np.uint8)[:sizes[src]],
                           self.message(step, src, me, sizes[src]).tobytes(), step=step, src=src)

        return calls, [(out.ptr, out.view(np.uint8)), (into.ptr, into.view(np.uint8))], verify

    def grouped(self, calls: list[Callable[[], None]]) -> None:
        self.comm.group_start()
        self.group_open = True
        for call in calls:
            call()
        self.group_open = False
        self.comm.group_end()

    def do_p2p_group(self, step: int, rng: random.Random, local: random.Random) -> None:
        calls, spans, verify = self.exchange(step, rng)
        # a rank's send and receive: which goes first in the group is the rank's own choice
        local.shuffle(calls)
        with self.kept_on_failure("p2p group", *spans, step=step), \
                self.watch.call("p2p group", self.call_bound):
            self.grouped(calls)
        verify()

    def do_coll_group(self, step: int, rng: random.Random, local: random.Random) -> None:
        """An all_reduce on a kept buffer in one group with the p2p exchange: a failure that
        ends the group's receive while the engine still runs its all_reduce must not hand
        the buffer back before the all_reduce let go of it."""
        dtype, op = rng.choice(DTYPES), rng.choice(OPS)
        itemsize = np.dtype(_numpy(dtype)).itemsize
        top = min(self.s.max_bytes, COLL_GROUP_BYTES) // itemsize
        nelem = self.size(rng, itemsize) if rng.random() < 0.5 else rng.randint(1, top)
        if (dtype, op) == ("i64", "max") and nelem in (2, 3):
            nelem = 4  # (never the control step's or the agreement's call, paired by mistake)
        inputs = self.inputs(step, nelem, dtype, op)
        mine = inputs[self.s.rank]
        calls, spans, verify = self.exchange(step, rng)
        buf = local.choice(self.kept)  # (mapped by the daemon for the whole run: a late write shows)
        offset = 8 * local.randint(0, 1024)
        ptr, view = buf.ptr + offset, buf.view(np.uint8)[offset:offset + mine.nbytes]
        view[:] = mine.view(np.uint8)
        calls.append(lambda: self.comm.all_reduce(ptr, mine.nbytes, dtype=dtype, op=op))
        # (where the all_reduce stands among its sends and receives is the rank's own choice)
        local.shuffle(calls)
        with self.kept_on_failure("all_reduce+p2p group", (ptr, view), *spans, step=step), \
                self.watch.call("all_reduce+p2p group", self.call_bound):
            self.grouped(calls)
        self.check("all_reduce in group", view, self.reduced(inputs, dtype, op).tobytes(), step=step,
                   dtype=dtype, op=op, nelem=nelem)
        verify()

    def do_p2p_pair(self, step: int, rng: random.Random, local: random.Random) -> None:
        """Two ranks, ungrouped: the lower sends then receives, the higher the reverse."""
        a, b = sorted(rng.sample(range(self.s.n), 2))
        nbytes = self.size(rng, 1)
        me = self.s.rank
        if me not in (a, b):
            return
        peer = b if me == a else a
        with self.span(nbytes, local, allow_sym=False, slot=0) as (optr, oview), \
                self.span(nbytes, local, allow_sym=False, slot=1) as (iptr, iview):
            oview[:] = self.message(step, me, peer, nbytes)
            iview[:] = 0xEE
            order = ["send", "recv"] if me == a else ["recv", "send"]
            for what in order:
                with self.kept_on_failure(what, (optr, oview), (iptr, iview), step=step), \
                        self.watch.call(what, self.call_bound):
                    if what == "send":
                        self.comm.send_to(optr, nbytes, peer, 0)
                    else:
                        self.comm.recv_from(iptr, nbytes, peer, 0)
            self.check("recv", iview, self.message(step, peer, me, nbytes).tobytes(), step=step, src=peer)

    def do_cmd(self, step: int, rng: random.Random, local: random.Random) -> None:
        command = rng.getrandbits(32)
        with self.span(4, local) as (ptr, view):
            words = view.view(np.uint32)
            if self.s.rank == 0:
                words[0] = command
                with self.kept_on_failure("broadcast command", (ptr, view), step=step), \
                        self.watch.call("broadcast command", self.call_bound):
                    self.comm.broadcast(ptr, 4, 0)
            else:
                words[0] = 0
                # no deadline: it waits for rank 0, which may be stopped as long as chaos stops one
                bound = self.call_bound + self.s.timeout + self.s.max_stop
                with self.kept_on_failure("recv_command_u32", (ptr, view), step=step), \
                        self.watch.call("recv_command_u32", bound):
                    self.comm.recv_command_u32(ptr, 0)
            self.check("recv_command_u32", view, np.array([command], np.uint32).tobytes(), step=step)

    def do_reg(self, step: int, rng: random.Random, local: random.Random) -> None:
        """Register a span of a kept buffer, all_reduce in it; keep up to 3 registrations."""
        nelem = self.size(rng, 4)
        inputs = self.inputs(step, nelem, "i32", "sum")
        index, offset = local.randrange(len(self.kept)), 8 * local.randint(0, 1024)
        buf = self.kept[index]
        with self.watch.call("register_buffer", self.call_bound):
            handle = self.comm.register_buffer(buf.ptr + offset, max(4 * nelem, 1))
        self.handles.append((handle, index, offset))
        view = buf.view(np.uint8)[offset:offset + 4 * nelem]
        view[:] = inputs[self.s.rank].view(np.uint8)
        with self.kept_on_failure("all_reduce registered", (buf.ptr + offset, view), step=step), \
                self.watch.call("all_reduce registered", self.call_bound):
            self.comm.all_reduce(buf.ptr + offset, 4 * nelem, dtype="i32", op="sum")
        self.check("all_reduce registered", view, self.reduced(inputs, "i32", "sum").tobytes(), step=step)
        while len(self.handles) > 3:
            old = self.handles.pop(0)
            with self.watch.call("deregister_buffer", self.call_bound):
                self.comm.deregister_buffer(old[0])

    def do_sym(self, step: int, rng: random.Random, local: random.Random) -> None:
        """A fresh symmetric allocation, all_reduce in it, free."""
        import ctypes

        nelem = self.size(rng, 4)
        inputs = self.inputs(step, nelem, "f32", "sum")
        with self.watch.call("symmetric_alloc", self.call_bound):
            ptr = self.comm.symmetric_alloc(max(4 * nelem, 1))
        try:
            view = np.ctypeslib.as_array((ctypes.c_uint8 * max(4 * nelem, 1)).from_address(ptr))[:4 * nelem]
            view[:] = inputs[self.s.rank].view(np.uint8)
            with self.watch.call("all_reduce symmetric", self.call_bound):
                self.comm.all_reduce(ptr, 4 * nelem, dtype="f32", op="sum")
            self.check("all_reduce symmetric", view, self.reduced(inputs, "f32", "sum").tobytes(), step=step)
        finally:
            with self.watch.call("symmetric_free", self.call_bound):
                self.comm.symmetric_free(ptr)


def _sentinel(nbytes: int) -> Any:
    return np.resize(np.frombuffer(SENTINEL, np.uint8), nbytes)


def _numpy(dtype: str) -> Any:
    from tests.integration.data import NUMPY

    return NUMPY[dtype]


def worker_main(spec: WorkerSpec) -> None:
    os.chdir(ROOT)
    worker = Worker(spec)
    try:
        worker.run()
    finally:
        with contextlib.suppress(Exception):
            if worker.comm is not None:
                worker.comm.close()
        worker.logf.close()


# ---------------------------------------------------------------------------------------
# the driver side


@dataclass
class Daemon:
    name: str
    dir: Path
    multi: bool
    port: int = 0
    proc: Any = None
    kills: int = 0
    stops: int = 0
    longest_stop: float = 0.0
    base: tuple[int, int] = (0, 0)

    @property
    def sock(self) -> Path:
        return self.dir / "commd.sock"

    def start(self) -> None:
        from commd.launch import DaemonProcess

        args = ["--peer-listen", f"127.0.0.1:{self.port}", "--peer-name", self.name,
                "--peer-heartbeat", "0.2", "--peer-window", "1.0"] if self.multi else []
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "daemon.log", "ab")  # noqa: SIM115 - the daemon's lifetime
        deadline = time.monotonic() + 20
        while True:
            try:
                self.proc = DaemonProcess(self.sock, env={"COMMD_PEER_SECRET": SECRET}, args=args,
                                          log=log, log_level="WARNING").start()
                break
            except RuntimeError:  # the port was taken by a connection's local end for a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if self.multi and not self.port:
            self.port = int(self.proc.peer_address().rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.kill()
        self.kills += 1

    def term(self, bound: float) -> tuple[int, float]:
        """SIGTERM; its exit code (the kill's, -9, past `bound`) and the seconds it took."""
        start = time.monotonic()
        code = self.proc.stop(bound)
        took = time.monotonic() - start
        self.stops += 1
        self.longest_stop = max(self.longest_stop, round(took, 2))
        return code, took

    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None


@dataclass
class Live:
    spec: WorkerSpec
    proc: Any
    stopped: bool = False
    killed: bool = False


@dataclass
class Report:
    config: dict[str, Any]
    faults: Counter[str] = field(default_factory=Counter)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    worlds: dict[str, dict[str, Any]] = field(default_factory=dict)
    daemons: dict[str, dict[str, Any]] = field(default_factory=dict)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.dir = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
        self.stopfile = str(self.dir / "STOP")
        self.rng = random.Random(args.seed)
        self.ctx = mp.get_context("spawn")
        self.lock = threading.Lock()
        self.daemons = [Daemon("ABC"[i], self.dir / "ABC"[i], args.daemons > 1) for i in range(args.daemons)]
        self.worlds = [[int(d) for d in w.split(",")] for w in args.worlds.split(";")]
        self.live: dict[tuple[str, int], Live] = {}
        self.dead_logs: list[str] = []
        self.proxies: dict[tuple[int, int], Any] = {}
        self.report = Report(config=vars(args) | {"dir": str(self.dir)})
        self.done = threading.Event()
        self.busy: set[Any] = set()  # what faults hold: a worker's key, a daemon, a link

    def anomaly(self, kind: str, **info: Any) -> None:
        if sum(a["kind"] == kind for a in self.report.anomalies) < 5:  # (all go to the report)
            print(f"ANOMALY {kind}: {str(info)[:2000]}", flush=True)
        self.report.anomalies.append({"kind": kind, **info})

    def spec(self, index: int, placement: list[int], rank: int, generation: int) -> WorkerSpec:
        world = f"soak{index}"
        root = placement[0]
        home = placement[rank]
        if len(self.daemons) > 1:
            proxy = self.proxies.get((home, root))
            boot = proxy.address if proxy is not None else f"127.0.0.1:{self.daemons[root].port}"
            sock = f"{self.daemons[home].sock}@{boot}"
        else:
            sock = str(self.daemons[home].sock)
        by_daemon: dict[int, list[int]] = {}
        for r, d in enumerate(placement):
            by_daemon.setdefault(d, []).append(r)
        return WorkerSpec(world, rank, len(placement), sock, list(by_daemon.values()), self.a.timeout,
                          self.a.seed, str(self.dir / f"{world}-r{rank}-g{generation}.jsonl"), self.stopfile,
                          self.a.slack, self.max_stop, self.a.max_bytes, generation, self.a.side)

    @property
    def max_stop(self) -> float:
        return 2.5 * float(self.a.timeout)

    def spawn(self, spec: WorkerSpec) -> None:
        proc = self.ctx.Process(target=worker_main, args=(spec,), daemon=True,
                                name=f"{spec.world}-r{spec.rank}-g{spec.generation}")
        proc.start()
        self.live[(spec.world, spec.rank)] = Live(spec, proc)

    # ---- faults

    def fault(self, rng: random.Random) -> None:
        kinds = [k for k in self.a.faults.split(",") if k != "net" or self.proxies]
        kind = rng.choice(kinds)
        with self.lock:
            self.report.faults[kind] += 1
        getattr(self, "fault_" + kind.replace("-", "_"))(rng)

    @contextlib.contextmanager
    def target(self, rng: random.Random, choices: list[Any]) -> Iterator[Any]:
        """One of `choices` no other fault holds (None if all are held), held meanwhile."""
        with self.lock:
            free = [c for c in choices if c not in self.busy]
            chosen = rng.choice(free) if free else None
            self.busy.add(chosen)
        try:
            yield chosen
        finally:
            with self.lock:
                self.busy.discard(chosen)

    def fault_kill_worker(self, rng: random.Random) -> None:
        with self.target(rng, sorted(self.live)) as key:
            if key is None:
                return
            with self.lock:
                live = self.live[key]
                live.killed = True
                os.kill(live.proc.pid, signal.SIGKILL)
                live.proc.join(10)
                self.dead_logs.append(live.spec.log)
            print(f"  {time.strftime('%X')} kill -9 worker {key}", flush=True)
            time.sleep(rng.uniform(0, 0.6))
            world, rank = key
            index = int(world.removeprefix("soak"))
            with self.lock:
                self.spawn(self.spec(index, self.worlds[index], rank, live.spec.generation + 1))

    def fault_stop_worker(self, rng: random.Random) -> None:
        with self.target(rng, sorted(self.live)) as key:
            if key is None:
                return
            live = self.live[key]
            seconds = rng.uniform(0.2, 2.5) * self.a.timeout
            print(f"  {time.strftime('%X')} SIGSTOP worker {key} for {seconds:.2f}s", flush=True)
            live.stopped = True
            os.kill(live.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                with contextlib.suppress(ProcessLookupError):  # (it crashed meanwhile: reap tells)
                    os.kill(live.proc.pid, signal.SIGCONT)
                live.stopped = False

    def fault_kill_daemon(self, rng: random.Random) -> None:
        with self.target(rng, list(range(len(self.daemons)))) as index:
            if index is None:
                return
            daemon = self.daemons[index]
            down = rng.uniform(0.2, 1.0)
            print(f"  {time.strftime('%X')} kill -9 daemon {daemon.name}, down {down:.2f}s", flush=True)
            daemon.kill()
            time.sleep(down)
            daemon.start()

    def fault_stop_daemon(self, rng: random.Random) -> None:
        with self.target(rng, list(range(len(self.daemons)))) as index:
            if index is None:
                return
            daemon = self.daemons[index]
            seconds = rng.uniform(0.2, 2.5) * self.a.timeout
            print(f"  {time.strftime('%X')} SIGSTOP daemon {daemon.name} for {seconds:.2f}s", flush=True)
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)

    def fault_term_daemon(self, rng: random.Random) -> None:
        with self.target(rng, list(range(len(self.daemons)))) as index:
            if index is None:
                return
            daemon = self.daemons[index]
            down = rng.uniform(0.2, 1.0)
            bound = STOP_BOUND_S + self.a.slack
            print(f"  {time.strftime('%X')} SIGTERM daemon {daemon.name}, down {down:.2f}s", flush=True)
            code, took = daemon.term(bound)
            if code != 0:
                self.anomaly("stop", name=daemon.name, exitcode=code, took=round(took, 2), bound=bound,
                             log=str(daemon.dir / "daemon.log"))
            time.sleep(down)
            daemon.start()

    def fault_net(self, rng: random.Random) -> None:
        with self.target(rng, sorted(self.proxies)) as pair:
            if pair is None:
                return
            proxy = self.proxies[pair]
            how = rng.choice(["cut", "drop", "half_open"])
            seconds = rng.uniform(0.3, 2.5)
            print(f"  {time.strftime('%X')} network {how} {self.daemons[pair[0]].name}->"
                  f"{self.daemons[pair[1]].name} for {seconds:.2f}s", flush=True)
            getattr(proxy, how)()
            try:
                time.sleep(seconds)
            finally:
                proxy.heal()

    def chaos(self, until: float) -> None:
        """Faults one after another; with --overlap, up to two at once."""
        running: list[threading.Thread] = []
        try:
            while time.monotonic() < until:
                time.sleep(self.rng.uniform(*self.a.gap))
                if time.monotonic() >= until:
                    break
                rng = random.Random(self.rng.getrandbits(64))
                if not self.a.overlap:
                    self.fault(rng)
                    continue
                running = [t for t in running if t.is_alive()]
                if len(running) < 2:
                    thread = threading.Thread(target=self.guarded, args=(rng,), daemon=True)
                    thread.start()
                    running.append(thread)
            for thread in running:
                thread.join()
        except BaseException:
            self.anomaly("driver", error=traceback.format_exc())
        finally:
            self.done.set()

    def guarded(self, rng: random.Random) -> None:
        try:
            self.fault(rng)
        except BaseException:
            self.anomaly("driver", error=traceback.format_exc())

    def reap(self) -> None:
        """A worker that died without chaos killing it is a crash: noted, and replaced."""
        with self.lock:
            for key, live in list(self.live.items()):
                if not live.proc.is_alive() and not live.killed and not os.path.exists(self.stopfile):
                    self.anomaly("crash", worker=key, exitcode=live.proc.exitcode, log=live.spec.log)
                    self.dead_logs.append(live.spec.log)
                    index = int(key[0].removeprefix("soak"))
                    self.spawn(self.spec(index, self.worlds[index], key[1], live.spec.generation + 1))

    # ---- the run

    def run(self) -> int:
        from tests.integration.harness import held_at_rest

        for daemon in self.daemons:
            daemon.start()
        for daemon in self.daemons:
            daemon.base = self.at_rest(daemon, held_at_rest)
        if self.a.proxy and len(self.daemons) > 1:
            from tests.integration.faultproxy import FaultProxy

            for placement in self.worlds:
                for home in set(placement) - {placement[0]}:
                    if (home, placement[0]) not in self.proxies:
                        target = self.daemons[placement[0]].port
                        self.proxies[(home, placement[0])] = FaultProxy("127.0.0.1", target)
        for index, placement in enumerate(self.worlds):
            for rank in range(len(placement)):
                self.spawn(self.spec(index, placement, rank, 0))
        print(f"soak in {self.dir}: {len(self.daemons)} daemon(s), worlds {self.worlds}, "
              f"{self.a.duration:.0f}s, faults {self.a.faults}, seed {self.a.seed}", flush=True)
        until = time.monotonic() + self.a.duration
        chaos = threading.Thread(target=self.chaos, args=(until,), daemon=True)
        chaos.start()
        while not self.done.wait(0.5):
            self.reap()
        chaos.join()
        # the end: everyone resumed, every daemon up, the network healed; then stop
        with self.lock:
            for live in self.live.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(live.proc.pid, signal.SIGCONT)
            for proxy in self.proxies.values():
                proxy.heal()
        Path(self.stopfile).touch()
        deadline = time.monotonic() + self.a.end_timeout
        for key, live in sorted(self.live.items()):
            live.proc.join(max(0.1, deadline - time.monotonic()))
            if live.proc.is_alive():
                self.anomaly("crash", worker=key, why=f"did not finish {self.a.end_timeout}s after the stop",
                             log=live.spec.log)
                os.kill(live.proc.pid, signal.SIGKILL)
                live.proc.join(10)
            elif live.proc.exitcode != 0:
                self.anomaly("crash", worker=key, exitcode=live.proc.exitcode, log=live.spec.log)
        self.collect()
        self.check_daemons()
        for proxy in self.proxies.values():
            proxy.close()
        for daemon in self.daemons:
            if daemon.alive():
                daemon.proc.stop()
        return self.summary()

    @staticmethod
    def at_rest(daemon: Daemon, held_at_rest: Callable[[int], tuple[int, int]]) -> tuple[int, int]:
        fds, maps = held_at_rest(daemon.proc.pid)
        return fds - _tcp_links(daemon.proc.pid), maps

    def collect(self) -> None:
        logs = sorted({*self.dead_logs, *(live.spec.log for live in self.live.values())})
        worlds: dict[str, dict[str, Any]] = {}
        for log in logs:
            last: dict[str, Any] | None = None
            if not os.path.exists(log):
                continue
            with open(log) as lines:
                for line in lines:
                    try:
                        event = json.loads(line)
                    except ValueError:  # a worker killed mid-line
                        continue
                    if event["kind"] in ("wrong", "late-write", "untyped", "hang", "unexpected"):
                        self.anomaly(event["kind"], **{k: v for k, v in event.items() if k != "kind"})
                    if event["kind"] == "stacks":
                        self.anomaly("stacks", worker=(event["world"], event["rank"], event["gen"]),
                                     text=event["text"])
                    if event["kind"] in ("progress", "final"):
                        last = event
            if last is None:
                continue
            w = worlds.setdefault(last["world"], {"steps": 0, "counts": Counter(), "errors": Counter(),
                                                  "max_over": -1e9, "finals": 0})
            w["steps"] = max(w["steps"], last["steps"])
            w["counts"].update(last["counts"])
            w["errors"].update(last["errors"])
            w["max_over"] = max(w["max_over"], last["max_over"])
            w["finals"] += last["kind"] == "final"
        self.report.worlds = worlds

    def check_daemons(self) -> None:
        from commd.status import query_status
        from tests.integration.harness import held_at_rest

        for daemon in self.daemons:
            info: dict[str, Any] = {"kills": daemon.kills, "stops": daemon.stops,
                                    "longest_stop_s": daemon.longest_stop, "alive": daemon.alive()}
            self.report.daemons[daemon.name] = info
            if not daemon.alive():
                self.anomaly("daemon", name=daemon.name, why="not alive",
                             exitcode=daemon.proc.proc.returncode)
                continue
            try:
                status = query_status(str(daemon.sock), 10)
                info["worlds_left"] = [w["name"] for w in status["worlds"]]
                info["connections"] = status["connections"]
            except Exception as exc:
                self.anomaly("daemon", name=daemon.name, why=f"status: {exc!r}")
                continue
            deadline = time.monotonic() + 15
            while True:
                now = self.at_rest(daemon, held_at_rest)
                if now == daemon.base or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            info["held"], info["base"] = now, daemon.base
            info["tcp_links"] = _tcp_links(daemon.proc.pid)
            if now != daemon.base:
                self.anomaly("leak", name=daemon.name, held=now, base=daemon.base,
                             restarted=daemon.kills + daemon.stops > 0, worlds_left=info.get("worlds_left"))
        for daemon in self.daemons:
            text = (daemon.dir / "daemon.log").read_text(errors="replace")
            tracebacks = text.count("Traceback")
            self.report.daemons[daemon.name]["log_tracebacks"] = tracebacks
            if tracebacks:
                self.anomaly("daemon", name=daemon.name, why=f"{tracebacks} traceback(s) in its log",
                             log=str(daemon.dir / "daemon.log"))

    def summary(self) -> int:
        r = self.report
        out = {"config": r.config, "faults": dict(r.faults), "worlds": {
            k: {**v, "counts": dict(v["counts"]), "errors": dict(v["errors"])} for k, v in r.worlds.items()},
            "daemons": r.daemons, "anomalies": r.anomalies}
        (self.dir / "report.json").write_text(json.dumps(out, indent=1, default=str))
        print(f"faults injected: {dict(r.faults)}")
        for name, w in sorted(r.worlds.items()):
            print(f"world {name}: {w['steps']} steps, {sum(w['counts'].values())} counted, "
                  f"checked {w['counts'].get('checked', 0)}, reconnects {w['counts'].get('reconnects', 0)}, "
                  f"late-write checks {w['counts'].get('late_checked', 0)}, "
                  f"errors {dict(w['errors'])}, longest call past its bound {w['max_over']:+.2f}s, "
                  f"{w['finals']} final reports")
        for name, d in sorted(r.daemons.items()):
            print(f"daemon {name}: {d}")
        kinds = Counter(a["kind"] for a in r.anomalies)
        print(f"anomalies: {dict(kinds) or 'none'} (report: {self.dir / 'report.json'})")
        if not r.anomalies and not self.a.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        return 1 if r.anomalies else 0


def _tcp_links(pid: int) -> int:
    """The daemon's established TCP connections (peer links: kept between worlds, not a leak)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    links = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                cols = row.split()
                if cols[3] == "01" and cols[9] in inodes:  # ESTABLISHED
                    links += 1
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120, help="seconds of chaos (default 120)")
    parser.add_argument("--daemons", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--worlds", help="per world, the daemon of each rank: '0,0,1,1;1,0,0' "
                        "(default: a 4-rank and a 3-rank world spread over the daemons)")
    parser.add_argument("--faults", default=None,
                        help="comma-separated: kill-worker,stop-worker,kill-daemon,stop-daemon,term-daemon,"
                        "net (default: all that apply)")
    parser.add_argument("--proxy", action="store_true", help="members reach roots through a fault proxy")
    parser.add_argument("--timeout", type=float, default=2.0, help="the workers' call timeout (default 2)")
    parser.add_argument("--gap", type=float, nargs=2, default=(0.5, 4.0), metavar=("MIN", "MAX"),
                        help="seconds between faults, drawn uniformly (default 0.5 4)")
    parser.add_argument("--slack", type=float, default=5.0, help="seconds past a call's bound before "
                        "it counts as a hang (default 5: the machine is shared)")
    parser.add_argument("--max-bytes", type=int, default=5 << 20, help="the largest call (default 5 MiB)")
    parser.add_argument("--end-timeout", type=float, default=90.0)
    parser.add_argument("--side", action="store_true", help="a second thread per worker registers, "
                        "deregisters, allocates symmetric memory and reconnects too")
    parser.add_argument("--overlap", action="store_true", help="up to two faults at a time")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run's directory")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if args.worlds is None:
        args.worlds = {1: "0,0,0,0;0,0,0", 2: "0,0,1,1;1,0,0", 3: "0,1,2,2;2,0,1"}[args.daemons]
    if args.faults is None:
        args.faults = ",".join(["kill-worker", "stop-worker", "kill-daemon", "stop-daemon", "term-daemon",
                                *(["net"] if args.proxy else [])])
    args.gap = tuple(args.gap)
    placements = [[int(d) for d in w.split(",")] for w in args.worlds.split(";")]
    if any(d >= args.daemons for p in placements for d in p) or sum(map(len, placements)) > 8:
        parser.error("--worlds: daemons out of range, or more than 8 workers")
    if any(len(p) < 2 for p in placements):  # (its steps pair ranks: sends, receives)
        parser.error("--worlds: a world has at least 2 ranks")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
