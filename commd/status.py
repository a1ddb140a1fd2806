"""`commd status`: ask a running daemon over its socket and show the answer."""

from __future__ import annotations

import time
from typing import Any

import proto


def query_status(socket_path: str, timeout: float, world: str | None = None) -> dict[str, Any]:
    """The daemon's status report, or one world's (raises client errors: unreachable,
    unknown world)."""
    from client.errors import ProtocolError, from_code
    from client.transport import Transport

    def ignore(event: proto.Event) -> None:
        pass

    transport = Transport(socket_path, timeout, ignore)
    try:
        reply, _ = transport.request(proto.StatusQuery(transport.next_id(), world),
                                     time.monotonic() + timeout)
    finally:
        transport.close()
    if isinstance(reply, proto.Error):
        raise from_code(reply.code, reply.message)
    if not isinstance(reply, proto.StatusReport):
        raise ProtocolError(f"status answered with {type(reply).__name__}")
    return reply.info


def render_status(info: dict[str, Any]) -> str:
    lines = [
        f"commd {info.get('version')}  engine={info.get('engine')}  pid={info.get('pid')}  "
        f"uptime={info.get('uptime_s')}s  connections={info.get('connections')}",
    ]
    worlds = info.get("worlds") or []
    if not worlds:
        return "\n".join([*lines, "no worlds"])
    lines.append(f"{'world':<24} {'state':<8} {'epoch':>5} {'ranks':>9} {'pending':>7}  cause")
    for w in worlds:
        ranks = f"{len(w['ranks'])}/{w['world_size']}"
        lines.append(f"{w['name']:<24} {w['state']:<8} {w['epoch']:>5} {ranks:>9} "
                     f"{w['pending_calls']:>7}  {w.get('cause') or ''}")
        # each rank's newest call: the one behind, or pending among done ones, is the suspect
        for rank, calls in (w.get("recent_calls") or {}).items():
            if calls:
                last = calls[-1]
                lines.append(f"    rank {rank:>4}  #{last['seq']:<6} {last['state']:<8} "
                             f"{last['seconds']:>9.3f}s  {last['call']}")
    return "\n".join(lines)
