"""What daemons tell each other to find ranks that disagree across them (both engines).

Each collective's fingerprint (its canonical call) goes to the root, which compares
it with its own; each send's size goes to the receiver's daemon (through the root
when neither is the root), which compares it with its receive. The messages are
`proto.peer.Data`; these helpers name them and word the errors.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING

from proto import ErrorCode
from proto import peer as p

from ..errors import CallError, quoted
from .base import EngineOp, RecvOp, SendOp, TransferOp

if TYPE_CHECKING:
    from ..cluster import Inbox, WorldNet

PAIR = 1 << 16  # p2p transfers are named by src * PAIR + dst (ranks are < 65536)


def pair_of(src: int, dst: int) -> int:
    return src * PAIR + dst


def p2p_target(msg: p.Data) -> int | None:
    """The rank a relayed p2p message is for (the root forwards it to that rank's daemon)."""
    if msg.step in ("p2p", "p2p-check"):
        return msg.source % PAIR
    if msg.step in ("p2p-ack", "p2p-credit"):
        return msg.source // PAIR
    return None


def sender_rank(msg: p.Data) -> int | None:
    """The rank whose daemon first sends a message a member sends the root: one of its own
    ranks ("up" and "check" name the member's lowest, "add-ready" and "add-from" its rank;
    a transfer its source, its credit and ack its receiver). None for what only the root
    sends ("down", "up-credit", "add-propose")."""
    if msg.step in ("up", "check", "add-ready", "add-from"):
        return msg.source
    if msg.step in ("p2p", "p2p-check"):
        return msg.source // PAIR
    if msg.step in ("p2p-ack", "p2p-credit"):
        return msg.source % PAIR
    return None


def collective_mismatch(index: int, mine: int, my_call: str, theirs: int, their_call: str) -> CallError:
    return CallError(ErrorCode.MISMATCH, f"mismatched collective call {index}: rank {mine} called "
                                         f"{my_call}, rank {theirs} called {their_call}")


def p2p_mismatch(src: int, dst: int, index: int, sent: str, received: int, daemon: str) -> CallError:
    """Worded as one daemon's matcher words it: each call with its peer (the pair is each
    call's, so no daemon needs to be told it). `sent` is what `daemon`, the sender's, said it
    sends: a size that is no byte count is that daemon breaking the protocol, not rank `src`
    calling send_to with it (a mismatch that sent the operator to the workers' code)."""
    if not (sent.isascii() and sent.isdigit()):
        return CallError(ErrorCode.WORLD_FAILED, f"point-to-point {src}->{dst} call {index}: daemon "
                                                 f"{daemon} sent the size {quoted(sent, 100)}, which "
                                                 "is not a byte count")
    return CallError(ErrorCode.MISMATCH, f"mismatched point-to-point {src}->{dst} call {index}: rank "
                                         f"{src} called send_to(bytes={sent}, peer={dst}), rank {dst} "
                                         f"called recv_from(bytes={received}, peer={src})")


def device_check(net: WorldNet | None, inbox: Inbox | None, epoch: int, local_ranks: Sequence[int],
                 op: EngineOp) -> Coroutine[None, None, None] | None:
    """For an engine whose data does not cross the daemons' links (NCCL): members send
    the root the fingerprint of each collective, and the root gets a coroutine that
    compares every member's with its own; a send's daemon sends its size to the
    receiver's, whose receive gets a coroutine that compares."""
    if net is None or inbox is None or isinstance(op, TransferOp):
        return None
    if isinstance(op, SendOp):
        pair = pair_of(op.src_rank, op.dst_rank)
        net.send("root" if not net.is_root else net.placement[op.dst_rank],
                 p.Data(net.world, epoch, "p2p-check", op.tag.index, 0, pair, str(op.src.nbytes)))
        return None
    if isinstance(op, RecvOp):
        recv = op

        async def compare_sizes() -> None:
            pair = pair_of(recv.src_rank, recv.dst_rank)
            msg, _ = await inbox.get(("p2p-check", recv.tag.index, 0, pair))
            if msg.fingerprint != str(recv.dst.nbytes):
                raise p2p_mismatch(recv.src_rank, recv.dst_rank, recv.tag.index, msg.fingerprint,
                                   recv.dst.nbytes, net.placement[recv.src_rank])

        return compare_sizes()
    tag = op.tag
    if not net.is_root:
        net.send("root", p.Data(net.world, epoch, "check", tag.index, 0, min(local_ranks), tag.fingerprint))
        return None

    async def compare() -> None:
        for member in net.members():
            source = min(net.ranks_of(member))
            msg, _ = await inbox.get(("check", tag.index, 0, source))
            if msg.fingerprint != tag.fingerprint:
                raise collective_mismatch(tag.index, min(local_ranks), tag.fingerprint, source,
                                          msg.fingerprint)

    return compare()
