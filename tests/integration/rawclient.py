"""A client that speaks the wire format by hand, to send the daemon what no real client would."""

from __future__ import annotations

import array
import contextlib
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import msgpack

import proto
from commd.engine.hostmemory import create_memfd


class RawClient:
    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def send_bytes(self, data: bytes, fds: list[int] | None = None) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        self.sock.sendmsg([data], anc)

    def send(self, msg: proto.Message, fds: list[int] | None = None) -> None:
        self.send_bytes(proto.encode(msg), fds)

    def send_map(self, raw: dict[str, Any]) -> None:
        self.send_bytes(msgpack.packb(raw, use_bin_type=True))

    def recv(self) -> proto.Message | None:
        """The next message, or None at EOF."""
        data, anc, _, _ = self.sock.recvmsg(proto.MAX_MESSAGE_BYTES + 1, socket.CMSG_SPACE(16))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                for fd in array.array("i", payload[: len(payload) - len(payload) % 4]):
                    os.close(fd)
        if not data:
            return None
        return proto.decode(data, sum(len(p) // 4 for lvl, k, p in anc if k == socket.SCM_RIGHTS))

    def error(self) -> proto.Error:
        msg = self.recv()
        assert isinstance(msg, proto.Error), f"expected an Error, got {msg!r}"
        return msg

    def closed(self) -> bool:
        try:
            return self.recv() is None
        except ConnectionResetError:
            return True

    def join(self, world: str, rank: int = 0, world_size: int = 1,
             timeout_ms: int = 5000) -> proto.Message | None:
        self.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, world_size, timeout_ms))
        return self.recv()

    def import_memfd(self, request_id: int, buf: int, size: int) -> proto.Message | None:
        fd = create_memfd(size, "raw")
        try:
            self.send(proto.Import(request_id, buf, proto.MemKind.HOST, size), [fd])
        finally:
            os.close(fd)
        return self.recv()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dialed(path: str, timeout: float = 10) -> RawClient:
    """A RawClient at `path`, dialed again while the daemon's listen backlog is full (thousands
    of connects in a row outrun its accepts: a connect with a timeout then fails with EAGAIN)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return RawClient(path, timeout=60)
        except BlockingIOError:
            assert time.monotonic() < deadline, f"the daemon at {path} accepted no connection in {timeout}s"
            time.sleep(0.001)


def said_hello(stack: contextlib.ExitStack, hellos: Sequence[tuple[str, proto.Hello]]) -> list[RawClient]:
    """A connection for each (daemon socket, hello), closed with `stack`, every one dialed
    before the first hello is sent: the hellos reach the daemons together. (Dialed and said
    in turn, thousands of hellos came over as long as the daemons took to accept the
    connections, seconds on a loaded machine: past a join timeout counted from the first.)"""
    clients = [stack.enter_context(contextlib.closing(dialed(path))) for path, _ in hellos]
    for client, (_, hello) in zip(clients, hellos, strict=True):
        client.send(hello)
    return clients


def each_refused(clients: list[RawClient], code: proto.ErrorCode, message: str) -> None:
    """Every client, whose hello's id was its index + 1, was refused alike."""
    for rank, client in enumerate(clients):
        answer = client.recv()
        assert isinstance(answer, proto.Error) and answer.id == rank + 1, (rank, answer)
        assert (answer.code, answer.message) == (code, message), (rank, answer)


def barrier_took(a: RawClient, b: RawClient, request_id: int) -> float:
    """Seconds a barrier of the 2-rank world of `a` and `b` took (their sockets' timeout
    bounds the wait)."""
    started = time.monotonic()
    for raw in (a, b):
        raw.send(proto.Submit(request_id, (proto.Barrier(),)))
    assert a.recv() == proto.Ok(request_id) and b.recv() == proto.Ok(request_id)
    return time.monotonic() - started
