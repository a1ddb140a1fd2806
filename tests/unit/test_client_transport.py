"""The client's transport against a daemon that misbehaves: a packet it cannot decode
breaks the connection with a ProtocolError, and the fds that came with it are closed."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

import pytest

import proto
from client.errors import ProtocolError
from client.transport import Transport
from tests.integration.harness import open_fds

pytestmark = pytest.mark.timeout(30)


def test_fds_that_came_with_an_undecodable_packet_are_closed() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "bad.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        listener.listen(1)

        def bad_daemon() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(proto.MAX_MESSAGE_BYTES)  # the request
                fd = os.memfd_create("stray")
                try:
                    socket.send_fds(conn, [b"\xc1 not msgpack"], [fd])
                finally:
                    os.close(fd)
                conn.recv(1)  # until the client hangs up

        server = threading.Thread(target=bad_daemon)
        server.start()
        before = open_fds()
        transport = Transport(path, 5, lambda event, transport: None)
        try:
            with pytest.raises(ProtocolError, match="bad packet"):
                transport.request(proto.StatusQuery(transport.next_id(), None), None)
        finally:
            transport.close()
        server.join(10)
        listener.close()
        assert open_fds() == before - 1  # the listener; nothing the bad packet brought stays open
