"""A stand-in daemon for client tests that need no real one (see RecordingDaemon)."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from collections.abc import Callable

import proto

# What the stand-in sends for a request, in place of its own answer: packets, each with the
# fds that ride beside it (a misbehaving daemon's, see RecordingDaemon.answer)
Packets = list[tuple[bytes, list[int]]]


class RecordingDaemon:
    """Welcomes every hello, answers every request Ok (a fresh value), records what came;
    `drop()` closes the current connection (the daemon went away: the next call rejoins).
    `answer`, if set, may answer a request in its place (the packets it returns are sent,
    then their fds closed here; None: the usual answer), as a buggy or hostile daemon would.
    `max_message`: the packet limit its welcome announces, and keeps: a longer packet is
    refused as the daemon refuses a bad one (an Error with id 0, then the connection goes)."""

    def __init__(self, path: str) -> None:
        self.seen: list[tuple[int, object]] = []
        self.conns: list[socket.socket] = []
        self._values = itertools.count(1)
        self.gate: tuple[int, threading.Event, threading.Event] | None = None  # (buf, arrived, go)
        self.answer: Callable[[proto.Message], Packets | None] | None = None
        self.max_message = proto.MAX_MESSAGE_BYTES
        # Close a connection once its client hung up (a test that connects thousands of
        # times); else it stays open, for a test to see the client's side go
        self.close_when_done = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        self._listener.listen(4)
        threading.Thread(target=self._accept, daemon=True).start()

    def connections(self, kind: type) -> list[int]:
        """The connection (numbered as accepted) each message of `kind` came on, in order."""
        return [n for n, msg in self.seen if isinstance(msg, kind)]

    def _accept(self) -> None:
        for n in itertools.count():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(n, conn), daemon=True).start()

    def _serve(self, n: int, conn: socket.socket) -> None:
        self._answer(n, conn)
        if self.close_when_done:
            conn.close()

    def _answer(self, n: int, conn: socket.socket) -> None:
        while True:
            try:
                data, anc, _, _ = conn.recvmsg(proto.MAX_MESSAGE_BYTES, socket.CMSG_SPACE(16))
            except OSError:
                return
            if not data:
                return
            if len(data) > self.max_message:
                refusal = f"packet of {len(data)} bytes is over the {self.max_message}-byte limit"
                conn.send(proto.encode(proto.Error(0, proto.ErrorCode.BAD_MESSAGE, refusal)))
                conn.shutdown(socket.SHUT_RDWR)
                return
            fds = [fd for lvl, kind, raw in anc if kind == socket.SCM_RIGHTS
                   for fd in struct.unpack(f"{len(raw) // 4}i", raw)]
            for fd in fds:
                os.close(fd)
            msg = proto.decode(data, len(fds))
            self.seen.append((n, msg))
            if isinstance(msg, proto.Import) and self.gate is not None and msg.buf == self.gate[0]:
                self.gate[1].set()  # its reply waits for the test
                self.gate[2].wait(10)
            packets = self.answer(msg) if self.answer is not None else None
            if packets is not None:
                try:
                    for packet, sent in packets:
                        if sent:
                            socket.send_fds(conn, [packet], sent)
                        else:
                            conn.send(packet)
                except OSError:
                    pass  # (the client hung up, as it does on a packet it refuses)
                finally:
                    for _, sent in packets:
                        for fd in sent:
                            os.close(fd)
                continue
            if isinstance(msg, proto.Hello):
                reply: object = proto.Welcome(msg.id, proto.PROTOCOL_VERSION, "fake", "host", n + 1,
                                              self.max_message)
            elif isinstance(msg, proto.Forget):
                continue
            else:
                reply = proto.Ok(msg.id, value=next(self._values))
            try:
                conn.send(proto.encode(reply))
            except OSError:
                return  # (the client hung up)

    def answer_the_first_submit(self, reply: Callable[[proto.Submit], Packets]) -> None:
        """Answer the first call with `reply`'s packets in the daemon's place; the rest as usual."""
        answered: list[int] = []

        def answer(msg: proto.Message) -> Packets | None:
            if isinstance(msg, proto.Submit) and not answered:
                answered.append(msg.id)
                return reply(msg)
            return None

        self.answer = answer

    def drop(self) -> None:
        self.conns[-1].shutdown(socket.SHUT_RDWR)

    def last_word(self, packet: bytes) -> None:
        """Send `packet` on the current connection, then shut it, as the daemon closes with
        its last word. (Not send, then drop(): a client that reads the packet may connect
        anew before drop() runs, which would shut the new connection.)"""
        conn = self.conns[-1]
        conn.send(packet)
        conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
