"""The add path across two daemons: the collective from which both take it.

With each rank of a 2-rank world on a daemon of its own, each daemon decides alone how
it runs a bf16 sum, and the two must decide alike, op by op: one rank's exchange (a
send and a receive) facing the other's ncclAllReduce waits for ever. Each rank calls
set_add_kernel when it likes, and each daemon loads the kernel in its own time, so the
daemons agree on a collective index from which both take the path (`first`):

- the member, once its rank set the kernel and it is loaded there, sends the root
  `add-ready`; it holds nothing back;
- the root, once the same holds on its side and that came, holds its ops back, and
  proposes the next collective it has not run yet (`add-propose`);
- the member answers the later of that and its own next one (`add-from`), and takes the
  path from there at once: it ran none past it;
- the root takes it from there too, and lets its held ops through, in order.

Only the root waits, for one round trip, and only once both sides are ready: a daemon
whose kernel never loads never says so, and both keep summing with NCCL. Per epoch (the
messages go through the epoch's inbox): a rebuilt world agrees again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

from proto import ErrorCode
from proto import peer as p

from ..errors import CallError, quoted

if TYPE_CHECKING:
    from ..cluster import Inbox, WorldNet

log = logging.getLogger("commd.engine.nccl")

_MAX_INDEX = 1 << 63  # collective indexes are u64 on the wire; no world makes that many calls


class Admissions:
    """Ops held back while closed, let through in the order they came once open again;
    an op that comes while earlier ones are still on their way goes behind them."""

    def __init__(self) -> None:
        self._closed = False
        self._queue: deque[asyncio.Future[None]] = deque()

    def close(self) -> None:
        self._closed = True

    def open(self, failure: CallError | None = None) -> None:
        """`failure`: the ops held back fail with it (later ones come through)."""
        self._closed = False
        for waiter in self._queue:
            if not waiter.done():
                if failure is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(CallError(failure.code, failure.message))

    async def admit(self) -> None:
        """Returns at once, with no await, while open with nobody held."""
        if not self._closed and not self._queue:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        if not self._closed:  # opened, and those it let through have yet to run: behind them
            asyncio.get_running_loop().call_soon(_resolve, waiter)
        try:
            await waiter
        finally:
            self._queue.remove(waiter)
            del waiter  # (a failed wait's traceback holds this frame: no cycle through it)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AddAgreement:
    """One epoch's agreement, for the daemon hosting `rank` (the other rank is on the
    other daemon). `admissions` is the communicator's: the root closes it while it waits
    for the member's answer. `fail(message)` is told what ends it wrongly (a daemon
    breaking the protocol): the world fails."""

    def __init__(self, net: WorldNet, inbox: Inbox, epoch: int, rank: int, admissions: Admissions,
                 spawn: Callable[[Coroutine[None, None, None]], object], fail: Callable[[str], None]) -> None:
        self._net = net
        self._inbox = inbox
        self._epoch = epoch
        self._rank = rank
        self._peer = 1 - rank
        self._admissions = admissions
        self._spawn = spawn
        self._fail = fail
        self._started = False
        self._next = 0  # the next collective index not run yet here
        self.first: int | None = None  # collectives from this index on take the path

    def ran(self, index: int) -> None:
        """A collective of this index goes to the device (on one path or the other)."""
        self._next = max(self._next, index + 1)

    def start(self) -> None:
        """The rank here set the kernel, and it is loaded on its GPU."""
        if not self._started:
            self._started = True
            self._spawn(self._agree())

    async def _agree(self) -> None:
        try:
            await (self._lead() if self._net.is_root else self._follow())
        except CallError as exc:  # (the world failed: its inbox tells every wait)
            self._admissions.open(exc)
            return
        except BaseException:
            self._admissions.open(CallError(ErrorCode.WORLD_FAILED, "the communicator closed"))
            raise
        self._admissions.open()
        if self.first is not None:
            log.info("world %s: bf16 sums from collective #%d on take the add path (with daemon %s)",
                     self._net.world, self.first, self._other_daemon(),
                     extra={"world": self._net.world, "epoch": self._epoch})

    async def _lead(self) -> None:
        await self._inbox.get(("add-ready", 0, 0, self._peer))
        self._admissions.close()
        proposed = self._next
        self._send(self._net.placement[self._peer], "add-propose", proposed)
        msg, _ = await self._inbox.get(("add-from", 0, 0, self._peer))
        first = self._index_in(msg, "add-from")
        if first is not None and first < proposed:
            self._broken(f"answered collective #{first} to the proposal of #{proposed}, which it ran past")
            return
        self.first = first

    async def _follow(self) -> None:
        self._send("root", "add-ready", 0)
        msg, _ = await self._inbox.get(("add-propose", 0, 0, 0))
        proposed = self._index_in(msg, "add-propose")
        if proposed is not None:
            self.first = max(proposed, self._next)
            self._send("root", "add-from", self.first)

    def _send(self, daemon: str, step: str, index: int) -> None:
        source = 0 if step == "add-propose" else self._rank
        self._net.send(daemon, p.Data(self._net.world, self._epoch, step, 0, 0, source, str(index)))

    def _index_in(self, msg: p.Data, step: str) -> int | None:
        text = msg.fingerprint
        if text.isascii() and text.isdigit() and int(text) < _MAX_INDEX:
            return int(text)
        self._broken(f"sent {step} with the collective index {quoted(text, 100)}, which is none")
        return None

    def _broken(self, what: str) -> None:
        self._fail(f"world {self._net.world}: daemon {self._other_daemon()} {what} "
                   "(the add path's agreement)")

    def _other_daemon(self) -> str:
        return self._net.placement[self._peer]
