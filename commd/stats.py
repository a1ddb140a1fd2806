"""The daemon's counters: calls by op and outcome, bytes, latency, world changes, failures.

Plain integers in plain objects, bumped where the daemon already does the work
(a call's record closing, a world changing state), read by `commd status` and
the Prometheus collector. A call pays for a dict lookup, a few additions and a
bisect (a fraction of a microsecond against a ~100 µs round trip); nothing in
the call path knows about Prometheus. One object lives as long as the daemon:
worlds come and go, their counts stay.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Any

import proto

from . import ops

if TYPE_CHECKING:
    from .recorder import CallRecord

# Seconds: from a small call's ~50 µs to a 64 MiB call over daemons (~0.1 s) and stalls.
LATENCY_BOUNDS: tuple[float, ...] = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0)



class OpStats:
    """One op's counts. Latency and bytes count completed calls only: a failed call's
    duration says when the failure came, not how fast the op is."""

    __slots__ = ("buckets", "bytes", "done", "failed", "seconds")

    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.bytes = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(LATENCY_BOUNDS) + 1)  # the last: above every bound

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus histogram buckets: (upper bound, calls at or under it)."""
        out, total = [], 0
        for bound, count in zip((*map(str, LATENCY_BOUNDS), "+Inf"), self.buckets, strict=True):
            total += count
            out.append((bound, total))
        return out


class CallStats:
    def __init__(self) -> None:
        self.by_op: dict[str, OpStats] = {}
        # (op type, waits forever) -> by_op's entry: the call's name, without working it out
        # at every call
        self._by_kind: dict[tuple[type, bool], OpStats] = {}

    def record(self, record: CallRecord, state: str) -> None:
        """A call's record closed (the one per-call cost; keep it small)."""
        kind = (type(record.op), record.waits_forever)
        stats = self._by_kind.get(kind)
        if stats is None:
            name = ops.call_name(record.op)  # (the names messages use)
            stats = self._by_kind[kind] = self.by_op.setdefault(name, OpStats())
        if state != "done":
            stats.failed += 1
            return
        stats.done += 1
        stats.bytes += ops.nbytes(record.op)
        assert record.ended is not None
        took = record.ended - record.started
        stats.seconds += took
        stats.buckets[bisect.bisect_left(LATENCY_BOUNDS, took)] += 1


class DaemonStats:
    """Everything counted since the daemon started."""

    def __init__(self) -> None:
        self.calls = CallStats()
        self.transitions: dict[str, int] = {}  # world state entered -> times
        self.failures: dict[str, int] = {}  # ErrorCode name -> world failures it caused
        self.reconnects = 0  # attempt_reconnect calls of ranks
        self.last_failure: dict[str, dict[str, Any]] = {}  # world name -> its latest failure

    def transition(self, state: str) -> None:
        self.transitions[state] = self.transitions.get(state, 0) + 1

    def count_failure(self, world: str, epoch: int, code: proto.ErrorCode, message: str,
                      keep: bool = True) -> None:
        """A world's end that was a failure (a job's end, ranks leaving once their calls are
        done, is only the transition to "failed": no failure to count or show). `keep`: as
        the world's last failure, until `forget` (False: the world is gone already)."""
        self.failures[code.name] = self.failures.get(code.name, 0) + 1
        if not keep:
            return
        self.last_failure[world] = {"epoch": epoch, "code": code.name, "message": message,
                                    "at": round(time.time(), 3)}

    def forget(self, world: str) -> None:
        """A world ended: its last failure goes too (names are not kept forever)."""
        self.last_failure.pop(world, None)

    def summary(self) -> dict[str, Any]:
        """The counters for `commd status --json`."""
        return {
            "calls": {name: {"done": s.done, "failed": s.failed, "bytes": s.bytes,
                             "seconds": round(s.seconds, 6)}
                      for name, s in sorted(self.calls.by_op.items())},
            "world_transitions": dict(sorted(self.transitions.items())),
            "world_failures": dict(sorted(self.failures.items())),
            "reconnects": self.reconnects,
        }
