"""An engine's own error (NCCL's async error) fails the world like any other cause.

The real source of such errors is NCCL on a GPU, which CI lacks; here the host engine's
communicator is wrapped so that it reports one, and the world's handling is checked.
The same wrapping shows what else the world tells an engine: which ops came in one request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import proto
from client import CommError, DaemonBackend, hostmem
from commd.config import ServerConfig
from commd.engine.base import Communicator, Engine, EngineOp, Order
from commd.engine.host import HostEngine
from commd.engine.nccl import NcclEngine
from commd.engine.stuckwatch import StuckWatch
from commd.errors import CallError
from commd.server import Server
from commd.world import World, WorldState
from proto import ErrorCode
from tests.contract.fakegpu import FakeGpu
from tests.integration.harness import linked_servers
from tests.unit.test_nccl_engine import abort_started_in, until

pytestmark = pytest.mark.timeout(30)


class Reporting:
    """A host communicator that reports `error` once it is set."""

    reports_async_errors = True  # (so the world polls it, as it does NCCL's)

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.error: str | None = None

    def try_inline(self, op: EngineOp) -> bool:
        return self.inner.try_inline(op)

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        await self.inner.run(op, order, requests)

    def abort(self) -> None:
        self.inner.abort()

    def async_error(self) -> str | None:
        return self.error

    def __getattr__(self, name: str) -> object:  # the rest of the Communicator, as it is
        return getattr(self.inner, name)


class ReportingEngine:
    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.name = inner.name
        self.memory_kinds = inner.memory_kinds
        self.comms: list[Reporting] = []
        self.wrap: type[Reporting] = Reporting

    def communicator(self, *args: object, **kwargs: object) -> Reporting:
        comm = self.wrap(self.inner.communicator(*args, **kwargs))  # type: ignore[arg-type]
        self.comms.append(comm)
        return comm

    def __getattr__(self, name: str) -> object:  # the rest of the Engine, as it is
        return getattr(self.inner, name)


class Rank:
    """A rank's connection: what the world sends it."""

    def __init__(self) -> None:
        self.received: list[proto.Reply] = []

    def send(self, msg: proto.Reply, fds: Sequence[int] = ()) -> None:
        self.received.append(msg)

    def close_if_hung_up(self) -> bool:
        return False  # (always connected)


def hello(rank: int) -> proto.Hello:
    return proto.Hello(id=1, version=proto.PROTOCOL_VERSION, pid=100 + rank, world="w", rank=rank,
                       world_size=2, timeout_ms=10_000)


def two_rank_world(wrap: type[Reporting] = Reporting
                   ) -> tuple[HostEngine, ReportingEngine, World, list[Rank]]:
    """A 2-rank world over the host engine, its communicators wrapped in `wrap`, both
    ranks joined (it is ready)."""
    host = HostEngine(threads=1)
    engine = ReportingEngine(host)
    engine.wrap = wrap
    world = World("w", 2, None, engine, lambda w: None)  # type: ignore[arg-type]
    ranks = [Rank(), Rank()]
    for r, peer in enumerate(ranks):
        world.join(peer, hello(r))
    return host, engine, world, ranks


async def test_an_async_engine_error_fails_every_rank_and_a_reconnect_rebuilds() -> None:
    host, engine, world, ranks = two_rank_world()
    assert world.state is WorldState.READY and world.epoch == 1
    world.submit(0, ranks[0], 7, [(proto.Barrier(), ())])  # rank 0 waits in a barrier rank 1 never makes
    engine.comms[-1].error = "ncclRemoteError: a remote rank's NCCL failed"
    for _ in range(40):
        if world.state is WorldState.FAILED:
            break
        await asyncio.sleep(0.05)
    assert world.state is WorldState.FAILED and world.cause_code is ErrorCode.ENGINE
    assert world.cause == "engine error: ncclRemoteError: a remote rank's NCCL failed"
    (failed_call,) = [m for m in ranks[0].received if isinstance(m, proto.Error)]
    assert failed_call.id == 7 and failed_call.code is ErrorCode.ENGINE
    assert "ncclRemoteError" in failed_call.message
    for peer in ranks:  # pushed to every rank, so one blocked elsewhere wakes too
        events = [m for m in peer.received if isinstance(m, proto.Event)]
        assert [(e.kind, e.code, e.epoch) for e in events] == [
            (proto.EventKind.WORLD_FAILED, ErrorCode.ENGINE, 1)]
    for r, peer in enumerate(ranks):
        world.reconnect(r, peer, 20 + r, 10.0)
    assert world.state is WorldState.READY and world.epoch == 2
    assert [m.value for p in ranks for m in p.received if isinstance(m, proto.Ok)] == [2, 2]
    for r in range(2):  # the new epoch's communicator is healthy: the barrier completes
        world.submit(r, ranks[r], 30 + r, [(proto.Barrier(), ())])
    for _ in range(40):
        if all(any(isinstance(m, proto.Ok) and m.id == 30 + r for m in p.received)
               for r, p in enumerate(ranks)):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the barrier after the rebuild never completed")
    assert world.state is WorldState.READY
    host.close()


class Hanging(Reporting):
    """An engine whose op never finishes until the communicator is aborted (an NCCL kernel
    waiting on a peer that is gone)."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.aborted = asyncio.Event()

    def try_inline(self, op: EngineOp) -> bool:
        return False

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        await self.aborted.wait()
        raise CallError(ErrorCode.WORLD_FAILED, "communicator was aborted")

    def abort(self) -> None:
        self.aborted.set()
        self.inner.abort()


async def test_a_failed_worlds_hung_op_is_aborted_after_a_grace() -> None:
    host, engine, world, ranks = two_rank_world(Hanging)
    for r in range(2):
        world.submit(r, ranks[r], 40 + r, [(proto.Barrier(), ())])  # matched, in the engine, never done
    await asyncio.sleep(0.1)
    comm = engine.comms[-1]
    assert isinstance(comm, Hanging) and not comm.aborted.is_set()
    world.leave(1, ranks[1])  # the world fails; its op is still in the engine's hands
    assert not comm.aborted.is_set()  # ops in the engine get their chance to finish...
    await asyncio.wait_for(comm.aborted.wait(), 5)  # ...but one that cannot is aborted
    for _ in range(40):
        if any(isinstance(m, proto.Error) and m.id == 40 for m in ranks[0].received):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("rank 0's call was never answered")
    host.close()


class Recording(Reporting):
    """Every op goes to `run`, which records the requests it was told the op came in."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.requests: list[frozenset[object]] = []

    def try_inline(self, op: EngineOp) -> bool:
        return False

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        self.requests.append(requests)
        await self.inner.run(op, order, requests)


async def test_the_engine_is_told_which_ops_came_in_one_request() -> None:
    """A worker's group is one request: the engine may hand its ops to the device
    together, and must not join them with another request's (see ncclbatch.Batcher.launch_soon)."""
    host, engine, world, ranks = two_rank_world(Recording)
    for r in range(2):
        world.submit(r, ranks[r], 50 + r, [(proto.Barrier(), ()), (proto.Barrier(), ())])  # a group of two
        world.submit(r, ranks[r], 60 + r, [(proto.Barrier(), ())])
    for _ in range(40):
        if sum(isinstance(m, proto.Ok) for p in ranks for m in p.received) == 4:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the calls were never answered")
    comm = engine.comms[-1]
    assert isinstance(comm, Recording) and len(comm.requests) == 3
    grouped, alone = comm.requests[:2], comm.requests[2]
    assert grouped[0] == grouped[1] and len(grouped[0]) == 2  # one request of each rank
    assert len(alone) == 2 and not alone & grouped[0]
    host.close()


async def test_a_world_whose_nccl_init_comes_after_an_abort_and_fails_says_why() -> None:
    """A world formed while another's ncclCommAbort runs is welcomed, and inits once the
    abort returned; refused then (two ranks on one GPU), the world fails naming why, as
    the hello would have been refused with it."""
    gpu = FakeGpu(devices=1, multi_rank_gpu=False)
    engine = NcclEngine(gpu, stuck=StuckWatch(20.0))
    try:
        await abort_started_in(engine, gpu, 0.5)
        world = World("w", 2, None, engine, lambda w: None)  # type: ignore[arg-type]
        ranks = [Rank(), Rank()]
        for r, peer in enumerate(ranks):
            world.join(peer, hello(r))
        assert world.state is WorldState.READY
        for r in range(2):
            world.submit(r, ranks[r], 30 + r, [(proto.Barrier(), ())])
        # (the world fails by its watchdog or by its ops, whichever comes first: both say why)
        await until(lambda: all(any(isinstance(m, proto.Error) for m in peer.received) for peer in ranks))
        assert world.state is WorldState.FAILED
        assert "NCCL init failed: Duplicate GPU detected" in (world.cause or "")
        errors = [m for peer in ranks for m in peer.received if isinstance(m, proto.Error)]
        assert len(errors) == 2 and all("NCCL init failed" in m.message for m in errors)
    finally:
        engine.close()


class NoCommunicators(ReportingEngine):
    """An engine that cannot build this daemon's communicators (NCCL: "Duplicate GPU
    detected", a device gone bad), failing as NcclEngine.communicator does."""

    def communicator(self, *args: object, **kwargs: object) -> Reporting:
        raise CallError(ErrorCode.ENGINE, "NCCL init failed: Duplicate GPU detected")


class NoUniqueId(ReportingEngine):
    """An engine that cannot make a new world's id (NCCL: ncclGetUniqueId failing, the
    driver or the network unusable), failing as NcclEngine.unique_id does."""

    def unique_id(self) -> bytes:
        raise CallError(ErrorCode.ENGINE, "ncclGetUniqueId failed: unhandled system error")


async def two_daemons_one_rank_each(tmp_path: Path, engines: Sequence[Any]) -> list[tuple[str, float]]:
    """Rank 0 on the root A, rank 1 on B, each daemon on its engine: what each rank met
    (refused at its join, or its first call's error and how long it waited for it). Real
    daemons' servers and peer links over loopback, in this process; the ranks are threads."""

    def rank(r: int) -> tuple[str, float]:
        try:
            comm = DaemonBackend(str(tmp_path / f"{'AB'[r]}.sock"), "w", r, 2, timeout=10,
                                 bootstrap=f"127.0.0.1:{port}")
        except CommError as exc:
            return f"refused: {type(exc).__name__}: {exc}", 0.0
        with comm:
            started = time.monotonic()
            try:
                comm.barrier()
            except CommError as exc:
                return f"{type(exc).__name__}: {exc}", time.monotonic() - started
            return "the barrier of a world without the other rank completed", 0.0

    async with linked_servers(tmp_path, engines, b"engine error test secret") as (_, port):
        return list(await asyncio.gather(*(asyncio.to_thread(rank, r) for r in range(2))))


@pytest.mark.parametrize("broken", [0, 1])
async def test_a_daemon_that_cannot_build_its_communicators_fails_the_world_everywhere(
        tmp_path: Path, broken: int) -> None:
    """One daemon's engine cannot build communicators. It refuses its rank and tells the
    other daemon, so the other rank's first call fails at once, naming why (before: only
    the broken daemon's rank heard; the other waited out its call timeout, and in a
    recv_command_u32, which has none, for ever)."""
    engines: list[Any] = [HostEngine(threads=1), HostEngine(threads=1)]
    engines[broken] = NoCommunicators(engines[broken])
    outcomes = await two_daemons_one_rank_each(tmp_path, engines)
    refused, (other, waited) = outcomes[broken][0], outcomes[1 - broken]
    assert refused.startswith("refused: EngineError") and "Duplicate GPU detected" in refused, refused
    assert other.startswith("EngineError") and f"daemon {'AB'[broken]} cannot take part" in other, other
    assert waited < 5, f"the other rank heard of it after {waited:.1f} s"


async def test_a_root_that_cannot_make_the_worlds_engine_id_refuses_every_rank_as_an_engine_error(
        tmp_path: Path) -> None:
    """The root's engine cannot make the new world's id: every rank, on either daemon, is
    refused with EngineError naming NCCL's failure (before: as WORLD_CONFLICT, a
    MisuseError, which tells the worker its own arguments were wrong; s23/K, read)."""
    outcomes = await two_daemons_one_rank_each(tmp_path, [NoUniqueId(HostEngine(threads=1)),
                                                           HostEngine(threads=1)])
    for said, _ in outcomes:
        assert said.startswith("refused: EngineError") and "ncclGetUniqueId failed" in said, outcomes


class FailsOnce(ReportingEngine):
    """An engine whose first communicator fails with an exception it should not raise (a
    bug of its own, or of a library under it)."""

    failed = False

    def communicator(self, *args: object, **kwargs: object) -> Reporting:
        if not self.failed:
            self.failed = True
            raise RuntimeError("an engine bug")
        return super().communicator(*args, **kwargs)


async def test_a_bug_while_a_world_forms_leaves_no_dead_rank_behind(tmp_path: Path) -> None:
    """The hello that hit the bug gets INTERNAL; its connection is no rank of the world, so
    the rank and the world's name are free for the next try (before such a failure kept
    the closed connection as the rank: "already connected" for good)."""
    engine = FailsOnce(HostEngine(threads=1))
    server = Server(ServerConfig(tmp_path / "d.sock"), engine, None)  # type: ignore[arg-type]
    server.start()

    def join() -> str:
        try:
            with DaemonBackend(str(tmp_path / "d.sock"), "w", 0, 1, timeout=5) as comm:
                comm.barrier()
        except CommError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    try:
        first = await asyncio.to_thread(join)
        second = await asyncio.to_thread(join)
    finally:
        server.shutdown()
    assert first.startswith("DaemonInternalError") and "an engine bug" in first, first
    assert second == "ok", second


class BuggyOnce(Reporting):
    """A communicator whose first op fails with an exception no engine should raise (a bug
    of its own, or of a library under it), on the loop (try_inline) or off it (run)."""

    failed = False

    def try_inline(self, op: EngineOp) -> bool:
        self._fail_once()
        return self.inner.try_inline(op)

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        self._fail_once()
        await self.inner.run(op, order, requests)

    def _fail_once(self) -> None:
        if not BuggyOnce.failed:
            BuggyOnce.failed = True
            raise RuntimeError("an op's bug")


async def test_an_engine_bug_in_an_op_fails_its_world_as_internal_and_a_reconnect_rebuilds(
        tmp_path: Path) -> None:
    """The world's first all_reduce meets a bug in the engine (a RuntimeError, no CallError):
    both ranks hear DaemonInternalError naming it, the world failed, the daemon serves on,
    and after attempt_reconnect on both the same call sums right."""
    BuggyOnce.failed = False
    engine = ReportingEngine(HostEngine(threads=1))
    engine.wrap = BuggyOnce
    server = Server(ServerConfig(tmp_path / "d.sock"), engine, None)  # type: ignore[arg-type]
    server.start()
    bufs = [hostmem.alloc(8) for _ in range(2)]

    def rank(r: int) -> tuple[str, bool, int, list[int]]:
        with DaemonBackend(str(tmp_path / "d.sock"), "w", r, 2, timeout=5) as comm:
            values = bufs[r].view(np.int32)
            values[:] = [r + 1, 10 * (r + 1)]
            try:
                comm.all_reduce(bufs[r].ptr, 8, dtype="i32")
                first = "ok"
            except CommError as exc:
                first = f"{type(exc).__name__}: {exc}"
            healthy = comm.is_healthy()
            comm.attempt_reconnect()
            values[:] = [r + 1, 10 * (r + 1)]
            comm.all_reduce(bufs[r].ptr, 8, dtype="i32")
            return first, healthy, comm.epoch, values.tolist()

    try:
        outcomes = await asyncio.gather(*(asyncio.to_thread(rank, r) for r in range(2)))
    finally:
        server.shutdown()
    assert BuggyOnce.failed
    for first, healthy, epoch, summed in outcomes:
        assert first.startswith("DaemonInternalError"), first
        assert "engine error: RuntimeError: an op's bug" in first, first
        assert (healthy, epoch, summed) == (False, 2, [3, 30])
