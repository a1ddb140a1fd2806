"""The add path's agreement between two daemons (commd/engine/addagree.py): from which
collective both take it, the root's ops held back meanwhile and let through in order,
and a daemon that breaks it. Two agreements talk through real inboxes; the daemons'
links are a hand-off between them (the real links are tests/integration's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pytest

from commd.cluster import Inbox
from commd.engine.addagree import AddAgreement, Admissions
from commd.errors import CallError
from proto import ErrorCode
from proto import peer as p

if TYPE_CHECKING:
    from commd.cluster import WorldNet

pytestmark = pytest.mark.timeout(10)


@dataclass
class Net:
    """What an agreement asks of WorldNet: who is root, where each rank is, a send."""

    me: str
    is_root: bool
    inboxes: dict[str, Inbox]
    world: str = "w"
    placement: tuple[str, ...] = ("A", "B")
    sent: list[p.Data] = field(default_factory=list)
    tamper: Callable[[p.Data], p.Data] = lambda msg: msg

    def send(self, daemon: str, msg: p.PeerMessage) -> None:
        assert isinstance(msg, p.Data)
        self.sent.append(msg)
        target = "A" if daemon == "root" else daemon
        asyncio.get_running_loop().call_soon(self.inboxes[target].deliver, self.tamper(msg), b"")


class Side:
    def __init__(self, net: Net, rank: int) -> None:
        self.admissions = Admissions()
        self.inbox = net.inboxes[net.me]
        self.failures: list[str] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.agreement = AddAgreement(cast("WorldNet", net), self.inbox, 1, rank, self.admissions,
                                      self._spawn, self.failures.append)

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)

    async def ended(self) -> None:
        await asyncio.gather(*self.tasks)


def pair(tamper: Callable[[p.Data], p.Data] = lambda msg: msg) -> tuple[Side, Side]:
    inboxes = {"A": Inbox(), "B": Inbox()}
    return Side(Net("A", True, inboxes), 0), Side(Net("B", False, inboxes, tamper=tamper), 1)


async def test_both_take_the_path_from_the_later_of_their_next_collectives() -> None:
    """The root ran collectives 0..4, the member 0..7 (its rank ahead, on async calls):
    the root proposes 5, the member answers 8, and both take the path from 8."""
    root, member = pair()
    for index in range(5):
        root.agreement.ran(index)
    for index in range(8):
        member.agreement.ran(index)
    member.agreement.start()
    root.agreement.start()
    await root.ended()
    await member.ended()
    assert root.agreement.first == member.agreement.first == 8
    assert root.failures == member.failures == []


async def test_a_member_behind_the_root_takes_the_roots_proposal() -> None:
    root, member = pair()
    for index in range(6):
        root.agreement.ran(index)
    member.agreement.ran(0)
    root.agreement.start()  # (the root first: it waits for the member's word, holding nothing)
    await asyncio.sleep(0.01)
    assert root.agreement.first is None
    op = asyncio.get_running_loop().create_task(root.admissions.admit())
    await asyncio.sleep(0.01)
    assert op.done()  # nothing held back before the member is ready
    member.agreement.start()
    await root.ended()
    await member.ended()
    assert root.agreement.first == member.agreement.first == 6


async def test_the_roots_ops_wait_for_the_answer_and_go_through_in_the_order_they_came() -> None:
    """While the root waits for `add-from`, its ops are held back; they go on once it came,
    in order, and one that comes while they are still on their way goes behind them."""
    root, member = pair()
    order: list[int] = []
    proposed = asyncio.Event()

    async def op(i: int) -> None:
        await root.admissions.admit()
        order.append(i)

    member_inbox = member.inbox
    deliver = member_inbox.deliver

    def stall_proposal(msg: p.Data, payload: bytes | bytearray) -> None:
        proposed.set()  # the member gets it only when the test says
        asyncio.get_running_loop().call_later(0.05, deliver, msg, payload)

    member_inbox.deliver = stall_proposal  # type: ignore[method-assign]
    member.agreement.start()
    root.agreement.start()
    await proposed.wait()
    ops = [asyncio.get_running_loop().create_task(op(i)) for i in range(5)]
    await asyncio.sleep(0.02)
    assert order == []  # held back: the answer has not come
    await root.ended()
    late = asyncio.get_running_loop().create_task(op(5))  # (the held ones have yet to run)
    await asyncio.gather(*ops, late)
    assert order == [0, 1, 2, 3, 4, 5]
    assert root.agreement.first == 0


@pytest.mark.parametrize("bad, words", [
    ("x1", "sent add-from with the collective index 'x1', which is none"),
    ("3", "answered collective #3 to the proposal of #4, which it ran past"),
    (str(1 << 63), f"sent add-from with the collective index '{1 << 63}', which is none"),
])
async def test_a_member_breaking_the_agreement_fails_the_world_and_the_held_ops_go_on(
        bad: str, words: str) -> None:
    """The root's `fail` names the member and what it sent; the ops held back are let
    through (the world's failure then fails them), none takes the path."""
    def tamper(msg: p.Data) -> p.Data:
        if msg.step != "add-from":
            return msg
        return p.Data(msg.world, msg.epoch, msg.step, msg.call, msg.chunk, msg.source, bad)

    root, member = pair(tamper)
    for index in range(4):
        root.agreement.ran(index)
    member.agreement.start()
    root.agreement.start()
    await root.ended()
    assert root.agreement.first is None
    assert root.failures == [f"world w: daemon B {words} (the add path's agreement)"]
    await asyncio.wait_for(root.admissions.admit(), 1)


async def test_a_world_failing_meanwhile_fails_the_ops_held_back() -> None:
    root, member = pair()
    member.inbox.deliver = lambda msg, payload: None  # type: ignore[method-assign]  # (never answers)
    member.agreement.start()
    root.agreement.start()
    await asyncio.sleep(0.02)
    held = asyncio.get_running_loop().create_task(root.admissions.admit())
    await asyncio.sleep(0.01)
    assert not held.done()
    root.inbox.fail(CallError(ErrorCode.PEER_LOST, "daemon B was lost"))
    with pytest.raises(CallError, match="daemon B was lost"):
        await held
    await root.ended()
    assert root.agreement.first is None and root.failures == []
    for task in member.tasks:
        task.cancel()
