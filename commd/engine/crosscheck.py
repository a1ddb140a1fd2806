"""What daemons tell each other to find ranks that disagree across them (both engines).

Each collective's fingerprint (its canonical call) goes to the root, which compares
it with its own; each send's size goes to the receiver's daemon (through the root
when neither is the root), which compares it with its receive. The messages are
`proto.peer.Data`; these helpers name them and word the errors.
"""

from __future__ import annotations

from proto import ErrorCode
from proto import peer as p

from ..errors import CallError

PAIR = 1 << 16  # p2p transfers are named by src * PAIR + dst (ranks are < 65536)


def pair_of(src: int, dst: int) -> int:
    return src * PAIR + dst


def p2p_target(msg: p.Data) -> int | None:
    """The rank a relayed p2p message is for (the root forwards it to that rank's daemon)."""
    if msg.step in ("p2p", "p2p-check"):
        return msg.source % PAIR
    if msg.step == "p2p-ack":
        return msg.source // PAIR
    return None


def collective_mismatch(index: int, mine: int, my_call: str, theirs: int, their_call: str) -> CallError:
    return CallError(ErrorCode.MISMATCH, f"mismatched collective call {index}: rank {mine} called "
                                         f"{my_call}, rank {theirs} called {their_call}")


def p2p_mismatch(src: int, dst: int, index: int, sent: str, received: int) -> CallError:
    return CallError(ErrorCode.MISMATCH, f"mismatched point-to-point {src}->{dst} call {index}: rank "
                                         f"{src} called send_to(bytes={sent}), rank {dst} called "
                                         f"recv_from(bytes={received})")
