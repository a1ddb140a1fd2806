"""`commd status`: ask a running daemon over its socket and show the answer."""

from __future__ import annotations

import time
from typing import Any

import proto


def query_status(socket_path: str, timeout: float, world: str | None = None) -> dict[str, Any]:
    """The daemon's status report, or one world's (raises client errors: unreachable,
    unknown world)."""
    from client.errors import CommTimeout, ProtocolError, from_code
    from client.transport import Transport

    def ignore(event: proto.Event, transport: Transport) -> None:
        pass

    # One deadline for the connect and the answer: a daemon whose backlog is full (its loop
    # stalled) took up to `timeout` to connect, and the answer had a whole `timeout` after
    deadline = time.monotonic() + timeout
    transport = Transport(socket_path, timeout, ignore, deadline)
    try:
        reply, _ = transport.request(proto.StatusQuery(transport.next_id(), world), deadline)
    except CommTimeout:  # (the transport's words name no daemon: a probe's log must)
        raise CommTimeout(f"the daemon at {socket_path} did not answer within {timeout:g}s") from None
    finally:
        transport.close()
    if isinstance(reply, proto.Error):
        raise from_code(reply.code, reply.message)
    if not isinstance(reply, proto.StatusReport):
        raise ProtocolError(f"status answered with {type(reply).__name__}")
    return reply.info


def render_status(info: dict[str, Any], calls_per_rank: int = 1) -> str:
    """A readable report: the daemon, its counters, a row per world, and each rank's newest
    calls from the flight recorder (`calls_per_rank` of them; all it sent with --world)."""
    metrics = f"  metrics=http://{info['metrics']}/metrics" if info.get("metrics") else ""
    lines = [
        f"commd {info.get('version')}  engine={info.get('engine_detail') or info.get('engine')}  "
        f"pid={info.get('pid')}  "
        f"uptime={info.get('uptime_s')}s  connections={info.get('connections')}  "
        f"ranks={info.get('ranks_connected')}{metrics}",
    ]
    if held := info.get("fd_closes_held"):
        lines.append(f"{held} fd(s) a client sent not closed yet, their filesystem's server not answering "
                     "the close: the daemon cannot exit until it does (README: FUSE)")
    lines += _counters(info.get("counters") or {})
    worlds = info.get("worlds") or []
    total = info.get("worlds_total", len(worlds))
    if len(worlds) < total:
        lines.append(f"{len(worlds)} of {total} worlds shown: the rest did not fit one report")
    if not worlds:
        return "\n".join([*lines, "no worlds"] if not total else lines)
    lines.append(f"{'world':<24} {'state':<8} {'epoch':>5} {'ranks':>9} {'here':<12} {'pending':>7}  "
                 "last failure")
    for w in worlds:
        ranks = f"{len(w['ranks'])}/{w['world_size']}"
        here = _ranks(w.get("local_ranks") or w["ranks"])
        lines.append(f"{w['name']:<24} {w['state']:<8} {w['epoch']:>5} {ranks:>9} {here:<12} "
                     f"{w['pending_calls']:>7}  {_failure(w)}")
        # each rank's newest calls: the one behind, or pending among done ones, is the suspect
        for rank, calls in (w.get("recent_calls") or {}).items():
            for call in calls[-calls_per_rank:]:
                lines.append(f"    rank {rank:>4}  #{call['seq']:<6} {call['state']:<8} "
                             f"{call['seconds']:>9.3f}s  {call['call']}")
    return "\n".join(lines)


def _counters(counters: dict[str, Any]) -> list[str]:
    calls = counters.get("calls") or {}
    if not calls and not counters.get("world_failures"):
        return []
    done = ", ".join(f"{op} {c['done']}" + (f" ({c['failed']} failed)" if c["failed"] else "")
                     for op, c in calls.items())
    failures = ", ".join(f"{cause} {n}" for cause, n in (counters.get("world_failures") or {}).items())
    return [f"calls: {done or 'none'}",
            f"world failures: {failures or 'none'}  reconnects: {counters.get('reconnects', 0)}"]


def _failure(world: dict[str, Any]) -> str:
    last = world.get("last_failure")
    if last:
        return f"epoch {last['epoch']} {last['code']}: {last['message']}"
    return world.get("cause") or ""


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"
