"""The Matcher against a reference model, on seeded random programs.

Each seed builds per-rank programs (collectives, recv_command_u32 beside the root's
broadcast, sends and receives between any pairs, send to self), cut into requests (a
group's calls arrive together, as World.submit adds them), and an interleaving of the
ranks' requests that keeps each rank's own order. The model is declarative: after every
arrival the set of complete matches is worked out from scratch (collective k: every
local rank has made k+1 collectives; p2p (s, d, k): both sides made k+1 calls), and the
Matcher must have returned exactly the one match that arrival completed. With one
call changed, the Matcher must raise Mismatch at the arrival that shows it, naming the
rank whose call fixed the index's form and the rank that disagreed. A failing seed is
rerun alone with `-k 'seed-N]'`.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

import proto
from commd import ops
from commd.matching import Call, CollectiveMatch, Match, Matcher, Mismatch, P2PMatch, RemoteP2P

pytestmark = pytest.mark.timeout(30)

SEEDS = range(300)
DTYPES = list(proto.DType)
REDUCE_OPS = list(proto.ReduceOp)
M = proto.Mem(1, 0)


@dataclasses.dataclass(frozen=True)
class Token:
    rank: int
    seq: int  # the call's place in its rank's program


def _nbytes(rng: random.Random, itemsize: int = 1) -> int:
    return itemsize * rng.choice([0, 1, 3, 7, 1001, rng.randrange(1 << 16)])


def _collective(rng: random.Random, n: int) -> list[proto.Op]:
    """One collective, as each rank calls it."""
    kind = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "command", "barrier"])
    if kind == "all_reduce":
        dtype = rng.choice(DTYPES)
        return [proto.AllReduce(M, _nbytes(rng, dtype.itemsize), dtype, rng.choice(REDUCE_OPS))] * n
    if kind == "all_gather":
        return [proto.AllGather(M, M, _nbytes(rng))] * n
    if kind == "reduce_scatter":
        dtype = rng.choice(DTYPES)
        return [proto.ReduceScatter(M, M, _nbytes(rng, dtype.itemsize), dtype, rng.choice(REDUCE_OPS))] * n
    root = rng.randrange(n)
    if kind == "broadcast":
        return [proto.Broadcast(M, _nbytes(rng), root)] * n
    if kind == "command":  # a non-root takes it either way
        return [proto.Broadcast(M, 4, root, command=r != root and rng.random() < 0.7) for r in range(n)]
    return [proto.Barrier()] * n


def programs(rng: random.Random, n: int) -> list[list[proto.Op]]:
    """Per rank, its calls in order: its collectives in the common order, its p2p calls
    in each (sender, receiver) pair's order, the streams merged at random."""
    streams: list[dict[object, list[proto.Op]]] = [{} for _ in range(n)]
    for _ in range(rng.randrange(1, 40)):
        if rng.random() < 0.5:
            for rank, op in enumerate(_collective(rng, n)):
                streams[rank].setdefault("coll", []).append(op)
        else:
            src, dst = rng.randrange(n), rng.randrange(n)
            size = _nbytes(rng)
            streams[src].setdefault(("send", dst), []).append(proto.Send(M, size, dst))
            streams[dst].setdefault(("recv", src), []).append(proto.Recv(M, size, src))
    out = []
    for rank_streams in streams:
        queues = [list(q) for q in rank_streams.values()]
        merged: list[proto.Op] = []
        while queues:
            queue = rng.choice(queues)
            merged.append(queue.pop(0))
            if not queue:
                queues.remove(queue)
        out.append(merged)
    return out


def arrivals(rng: random.Random, progs: dict[int, list[proto.Op]]) -> list[Call[Token]]:
    """The calls in one order the daemon may see them: each rank's program cut into
    requests of 1 to 5 calls (groups), the ranks' requests interleaved at random."""
    requests: dict[int, list[list[Call[Token]]]] = {}
    for rank, prog in progs.items():
        calls = [Call(rank, op, Token(rank, seq)) for seq, op in enumerate(prog)]
        cuts: list[list[Call[Token]]] = []
        while calls:
            size = rng.randint(1, 5) if rng.random() < 0.4 else 1
            cuts.append(calls[:size])
            calls = calls[size:]
        requests[rank] = cuts
    order: list[Call[Token]] = []
    while any(requests.values()):
        rank = rng.choice([r for r, q in requests.items() if q])
        order += requests[rank].pop(0)
    return order


class Model:
    """What has matched after a sequence of arrivals, worked out again after each one."""

    def __init__(self, world_size: int, local: tuple[int, ...]) -> None:
        self.local = local
        self.coll: dict[int, list[Call[Token]]] = {r: [] for r in local}
        self.sends: dict[tuple[int, int], list[Call[Token]]] = {}
        self.recvs: dict[tuple[int, int], list[Call[Token]]] = {}
        self.matched: dict[tuple[object, ...], tuple[Token, ...]] = {}

    def add(self, call: Call[Token]) -> dict[tuple[object, ...], tuple[Token, ...]]:
        """The matches this arrival completed (the model allows any number)."""
        if isinstance(call.op, proto.Send):
            self.sends.setdefault((call.rank, call.op.peer), []).append(call)
        elif isinstance(call.op, proto.Recv):
            self.recvs.setdefault((call.op.peer, call.rank), []).append(call)
        else:
            self.coll[call.rank].append(call)
        now = self.complete()
        new = {key: tokens for key, tokens in now.items() if key not in self.matched}
        self.matched = now
        return new

    def complete(self) -> dict[tuple[object, ...], tuple[Token, ...]]:
        out: dict[tuple[object, ...], tuple[Token, ...]] = {}
        for k in range(min(len(calls) for calls in self.coll.values())):
            out[("coll", k)] = tuple(self.coll[r][k].token for r in sorted(self.local))
        for side, table in (("send", self.sends), ("recv", self.recvs)):
            for (src, dst), calls in table.items():
                peer = dst if side == "send" else src
                if peer not in self.local:  # the other daemon pairs it: it is done here
                    for k, c in enumerate(calls):
                        out[("remote", side, src, dst, k)] = (c.token,)
        for (src, dst), sends in self.sends.items():
            recvs = self.recvs.get((src, dst), [])
            if dst in self.local and src in self.local:
                for k in range(min(len(sends), len(recvs))):
                    out[("p2p", src, dst, k)] = (sends[k].token, recvs[k].token)
        return out

    def pending(self) -> set[Token]:
        arrived = {c.token for calls in self.coll.values() for c in calls}
        arrived |= {c.token for table in (self.sends, self.recvs) for cs in table.values() for c in cs}
        return arrived - {t for tokens in self.matched.values() for t in tokens}


def key_of(match: Match[Token]) -> tuple[tuple[object, ...], tuple[Token, ...]]:
    if isinstance(match, CollectiveMatch):
        assert all(rank == call.rank for rank, call in match.calls.items())
        return ("coll", match.index), tuple(match.calls[r].token for r in sorted(match.calls))
    if isinstance(match, P2PMatch):
        assert isinstance(match.send.op, proto.Send) and isinstance(match.recv.op, proto.Recv)
        src, dst = match.send.rank, match.recv.rank
        assert (match.send.op.peer, match.recv.op.peer) == (dst, src)
        return ("p2p", src, dst, match.index), (match.send.token, match.recv.token)
    assert isinstance(match, RemoteP2P)
    op = match.call.op
    assert isinstance(op, proto.Send | proto.Recv)
    side = "send" if isinstance(op, proto.Send) else "recv"
    src, dst = (match.call.rank, op.peer) if side == "send" else (op.peer, match.call.rank)
    return ("remote", side, src, dst, match.index), (match.call.token,)


def setup(seed: int) -> tuple[random.Random, int, tuple[int, ...], dict[int, list[proto.Op]]]:
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    # a third of the seeds: this daemon holds only some ranks (the others are elsewhere)
    local = tuple(sorted(rng.sample(range(n), rng.randint(1, n)))) if rng.random() < 0.33 else ()
    progs = programs(rng, n)
    return rng, n, local, {r: progs[r] for r in (local or range(n))}


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed-{s}")
def test_matches_what_the_model_matches(seed: int) -> None:
    rng, n, local, progs = setup(seed)
    matcher: Matcher[Token] = Matcher(n, local)
    model = Model(n, local or tuple(range(n)))
    for step, call in enumerate(arrivals(rng, progs)):
        got = matcher.add(call)
        want = model.add(call)
        context = f"seed {seed}, arrival {step}: rank {call.rank} {ops.describe(call.op)}"
        assert len(want) <= 1, f"{context}: the model completed {want}"  # one call, one match
        assert (dict([key_of(got)]) if got is not None else {}) == want, context
        assert {c.token for c in matcher.pending()} == model.pending(), context
    assert matcher.pending() == [] and model.pending() == set(), f"seed {seed}: calls left unmatched"


def _changed(rng: random.Random, op: proto.Op, n: int) -> proto.Op:
    """`op` with one thing a matched call must agree on changed (it stays a collective,
    or a p2p call: its index among them is the same)."""
    if isinstance(op, proto.Send | proto.Recv):
        return dataclasses.replace(op, nbytes=op.nbytes + rng.choice([1, 2, 1000]))
    while True:
        choice = rng.randrange(4)
        if choice == 0:
            new: proto.Op = rng.choice(_collective(rng, n))
        elif choice == 1 and isinstance(op, proto.AllReduce | proto.ReduceScatter):
            new = dataclasses.replace(op, dtype=rng.choice(DTYPES), nbytes=0,
                                      op=rng.choice(REDUCE_OPS))
        elif choice == 2 and isinstance(op, proto.Broadcast) and n > 1:
            new = dataclasses.replace(op, root=rng.choice([r for r in range(n) if r != op.root]),
                                      command=False)
        elif choice == 3 and not isinstance(op, proto.Barrier):
            if isinstance(op, proto.Broadcast):
                op = dataclasses.replace(op, command=False)
            itemsize = getattr(getattr(op, "dtype", None), "itemsize", 1)
            new = dataclasses.replace(op, nbytes=op.nbytes + itemsize)
        else:
            continue
        if ops.fingerprint(new) != ops.fingerprint(op):
            return new


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed-{s}")
def test_one_disagreement_fails_naming_both_ranks_and_calls(seed: int) -> None:
    rng, n, local, progs = setup(seed)
    here = local or tuple(range(n))
    # a call this daemon can judge: a collective, or a p2p call whose other side is here
    candidates = [(r, i) for r, prog in progs.items() for i, op in enumerate(prog)
                  if not ops.is_p2p(op) or op.peer in here]  # type: ignore[union-attr]
    if not candidates:
        pytest.skip(f"seed {seed}: no call to change")
    rank, index = rng.choice(candidates)
    progs[rank][index] = _changed(rng, progs[rank][index], n)

    matcher: Matcher[Token] = Matcher(n, local)
    first: dict[tuple[object, ...], Call[Token]] = {}  # per coll or p2p index: who came first
    coll_seen: dict[int, int] = {}
    p2p_seen: dict[tuple[int, int, bool], int] = {}
    want: tuple[str, tuple[int, int], Call[Token], Call[Token]] | None = None
    for step, call in enumerate(arrivals(rng, progs)):
        op = call.op
        if isinstance(op, proto.Send | proto.Recv):
            is_send = isinstance(op, proto.Send)
            pair = (call.rank, op.peer) if is_send else (op.peer, call.rank)
            k = p2p_seen[(*pair, is_send)] = p2p_seen.get((*pair, is_send), -1) + 1
            key: tuple[object, ...] = ("p2p", *pair, k)
            kind = f"point-to-point {pair[0]}->{pair[1]} call {k}"
            judged = op.peer in here
        else:
            k = coll_seen[call.rank] = coll_seen.get(call.rank, -1) + 1
            key, kind, judged = ("coll", k), f"collective call {k}", True
        earlier = first.setdefault(key, call)
        if judged and ops.fingerprint(earlier.op) != ops.fingerprint(op):
            want = (kind, (earlier.rank, call.rank), earlier, call)
        context = f"seed {seed}, arrival {step}: rank {call.rank} {ops.describe(op)}"
        if want is None:
            matcher.add(call)
            continue
        with pytest.raises(Mismatch) as info:
            matcher.add(call)
        kind, ranks, a, b = want
        assert info.value.ranks == ranks, context
        assert str(info.value) == (f"mismatched {kind}: rank {a.rank} called {ops.describe(a.op)}, "
                                   f"rank {b.rank} called {ops.describe(b.op)}"), context
        return
    # the changed call met no call of another rank here (its partners are on other daemons)
    changed = progs[rank][index]
    assert not ops.is_p2p(changed) and len(here) == 1, f"seed {seed}: the disagreement went unseen"


def test_the_model_test_sees_a_matcher_that_pairs_across_directions(monkeypatch: Any) -> None:
    """The model is not the Matcher again: a Matcher that pairs a send with the reverse
    direction's recv (one counter per pair, not per direction) fails it."""

    def one_counter(self: Matcher[Any], call: Call[Any]) -> Any:
        op = call.op
        is_send = isinstance(op, proto.Send)
        pair = tuple(sorted((call.rank, op.peer)))  # type: ignore[union-attr]
        index = self._p2p_next.get((*pair, is_send), 0)
        self._p2p_next[(*pair, is_send)] = index + 1
        slot = self._p2p.setdefault((*pair, index), {})
        slot[is_send] = call
        if len(slot) < 2:
            return None
        del self._p2p[(*pair, index)]
        send, recv = slot[True], slot[False]
        return P2PMatch(index, send, recv)

    monkeypatch.setattr(Matcher, "_add_p2p", one_counter)
    failed = 0
    for seed in range(40):
        try:
            test_matches_what_the_model_matches(seed)
        except AssertionError:
            failed += 1
    assert failed > 0
