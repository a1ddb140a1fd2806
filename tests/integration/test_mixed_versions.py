"""Daemons of two builds in one cluster (a rolling upgrade): what one says that the other does
not know, over real links to real daemons (the other build is a raw peer that sends hand-made
frames after a real handshake, or a daemon process whose peer protocol is set another)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import proto
from client import DaemonBackend, PeerLost
from commd import __version__
from commd.launch import DaemonProcess
from commd.status import query_status
from proto import ErrorCode
from proto import peer as p
from proto.fields import MAX_WORLD_NAME
from tests.integration.harness import short_tmpdir, wait_until, world_name, world_status
from tests.integration.rawclient import RawClient
from tests.integration.test_multi_daemon import SECRET
from tests.integration.test_multi_daemon_faults import FAST, RawPeer, peer_daemon

pytestmark = pytest.mark.timeout(60)
NEWER_CODE = "quota_exceeded"  # an error code this build does not have
# `commd serve` as a newer build: the next peer protocol, whose hello has a field this one lacks,
# or (its first argument) an incarnation of another form (the command execs the daemon's, given
# as its last arguments: DaemonProcess's `under`)
NEWER_BUILD = [sys.executable, "-c", """
import runpy, sys
import msgpack
from proto import codec, peer

peer.PEER_VERSION += 1
encode_peer = codec.encode_peer

def newer(msg):
    header = encode_peer(msg)
    if isinstance(msg, peer.PeerHello):
        hello = msgpack.unpackb(header)
        header = msgpack.packb({**hello, "features": ["compression"]} if CHANGE == "features" else
                               {**hello, "incarnation": hello["incarnation"] * 2})
    return header

codec.encode_peer = newer
CHANGE = sys.argv[1]
sys.argv = ["commd", *sys.argv[5:]]
runpy.run_module("commd", run_name="__main__", alter_sys=True)
"""]


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """One daemon of this build, B, that declares a silent peer lost after 1 s."""
    yield from peer_daemon("B")


def hello(client: RawClient, world: str, rank: int, bootstrap: str) -> None:
    client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 2, 8000,
                            bootstrap=bootstrap))


def quiet(client: RawClient) -> bool:
    """Nothing comes to `client` for a while (no failure, no refusal)."""
    client.sock.settimeout(0.3)
    try:
        client.recv()
    except TimeoutError:
        return True
    return False


def voted_at(root: RawPeer, clients: list[RawClient], worlds: list[str]) -> Any:
    """Rank 1 of each world says hello to B with R's address: B links to R and votes there.
    The link R accepted."""
    address = root.listen()
    for client, world in zip(clients, worlds, strict=True):
        hello(client, world, 1, address)
    wait_until(lambda: all(root.got(p.JoinWorld, world=w) for w in worlds), timeout=10)
    (link,) = root.accepted
    return link


def test_a_root_s_failure_or_refusal_with_a_code_this_daemon_lacks_fails_that_world_alone(
        daemon: DaemonProcess) -> None:
    """The root R, of a newer build, fails one world and refuses a vote for another, each with
    an error code B does not know. Each must fail as R says, R's text and code told to the
    rank, and the third world over the same link must run on (before: B took either frame for
    a bad one and dropped the link: every world over it failed with "daemon R was lost: bad
    frame: 'quota_exceeded' is not a ErrorCode", R's text lost)."""
    root = RawPeer("R")
    failing, refused, steady = worlds = [world_name() for _ in range(3)]
    clients = [RawClient(str(daemon.socket_path), 10) for _ in worlds]
    try:
        link = voted_at(root, clients, worlds)
        for world in (failing, steady):
            root.send(link, p.WorldReady(world, 1, ("R", "B")))
        assert isinstance(clients[0].recv(), proto.Welcome) and isinstance(clients[2].recv(), proto.Welcome)
        fail_and_refuse_by_a_newer_code(root, link, (failing, f"world {failing}: R's quota is spent"),
                                        (refused, f"world {refused}: R takes no more worlds"))
        event = clients[0].recv()
        assert isinstance(event, proto.Event) and event.kind is proto.EventKind.WORLD_FAILED, event
        assert event.code is ErrorCode.WORLD_FAILED and event.epoch == 1
        assert event.message.startswith(f"world {failing}: R's quota is spent (code '{NEWER_CODE}' "
                                        "from daemon R, unknown to commd"), event.message
        error = clients[1].error()
        assert error.code is ErrorCode.WORLD_FAILED
        assert error.message.startswith(f"world {refused}: R takes no more worlds (code '{NEWER_CODE}' "
                                        "from daemon R"), error.message
        # the link, and the world beside them over it, live on
        assert quiet(clients[2]) and (world_status(daemon, steady) or {}).get("state") == "ready"
        assert query_status(str(daemon.socket_path), 5)["peers"]["links"] == ["R"] and not root.lost
    finally:
        for client in clients:
            client.close()
        root.close()


def fail_and_refuse_by_a_newer_code(root: RawPeer, link: Any, failing: tuple[str, str],
                                    refused: tuple[str, str]) -> None:
    """R, with NEWER_CODE and each its text: fails the world `failing` (epoch 1), and refuses
    rank 1's vote for the world `refused`."""
    (vote,) = [m.vote for _, m in root.received if isinstance(m, p.JoinWorld) and m.world == refused[0]]
    root.send_map(link, {"t": "world_failed", "world": failing[0], "epoch": 1, "code": NEWER_CODE,
                         "message": failing[1]})
    root.send_map(link, {"t": "join_refused", "world": refused[0], "rank": 1, "code": NEWER_CODE,
                         "message": refused[1], "vote": vote})


def test_a_long_failure_with_a_code_this_daemon_lacks_still_names_the_code(daemon: DaemonProcess) -> None:
    """R's failure and refusal with an unknown code and a text at the wire's limit: the note
    naming the code and R must reach the rank whole, R's text clipped before it (before: the
    note was appended after the longest text a message may carry, and the clip of the world's
    failure, or of the refusal, cut it off: the rank read R's text alone, code unknown)."""
    root = RawPeer("R")
    failing, refused = worlds = [world_name() for _ in range(2)]
    clients = [RawClient(str(daemon.socket_path), 10) for _ in worlds]
    long = "x" * 5000  # (a newer build may word a failure at more length; the frame clips it to 4096)
    note = f" (code '{NEWER_CODE}' from daemon R, unknown to commd {__version__})"
    try:
        link = voted_at(root, clients, worlds)
        root.send(link, p.WorldReady(failing, 1, ("R", "B")))
        assert isinstance(clients[0].recv(), proto.Welcome)
        fail_and_refuse_by_a_newer_code(root, link, (failing, f"world {failing}: {long}"),
                                        (refused, f"world {refused}: {long}"))
        event = clients[0].recv()
        assert isinstance(event, proto.Event) and event.code is ErrorCode.WORLD_FAILED, event
        error = clients[1].error()
        assert error.code is ErrorCode.WORLD_FAILED
        for world, message in [(failing, event.message), (refused, error.message)]:
            assert message.startswith(f"world {world}: xxx") and message.endswith(f" ... (cut){note}"), \
                message[-200:]
            assert len(message) <= proto.MAX_ERROR_TEXT - 96  # (room for what a call's error adds)
    finally:
        for client in clients:
            client.close()
        root.close()


@pytest.mark.parametrize("code", [NEWER_CODE, "timeout"], ids=["unknown-code", "known-code"])
def test_a_call_ended_by_a_long_failure_keeps_the_advice_and_the_note(
        daemon: DaemonProcess, code: str) -> None:
    """Root R fails a world of the longest name with a text at the wire's limit while rank 1's
    call waits on B, and the rank calls again after. Each call's error must name the world, say
    what to do next (attempt_reconnect), and, for a code B lacks, name that code and R: R's text
    is what gets clipped (before: the error was R's text framed by world, epoch and advice, then
    clipped again to the limit, which cut the advice and the note off)."""
    root = RawPeer("R")
    world = world_name().ljust(MAX_WORLD_NAME, "w")  # (the name frames the text twice)
    client = RawClient(str(daemon.socket_path), 10)
    note = f" (code '{NEWER_CODE}' from daemon R, unknown to commd {__version__})"
    try:
        address = root.listen()
        hello(client, world, 1, address)
        wait_until(lambda: root.got(p.JoinWorld, world=world), timeout=10)
        (link,) = root.accepted
        root.send(link, p.WorldReady(world, 1, ("R", "B")))
        assert isinstance(client.recv(), proto.Welcome)
        client.send(proto.Submit(2, (proto.Barrier(),), 1))
        wait_until(lambda: (world_status(daemon, world) or {}).get("pending_calls") == 1, timeout=5)
        root.send_map(link, {"t": "world_failed", "world": world, "epoch": 1, "code": code,
                             "message": f"world {world}: " + "x" * 5000})
        replies = [client.recv(), client.recv()]  # the event and the waiting call's error
        (error,) = [m for m in replies if isinstance(m, proto.Error)]
        client.send(proto.Submit(3, (proto.Barrier(),), 1))
        again = client.error()
        assert error.id == 2 and again.id == 3, (error, again)
        for message, advice in [(error.message, "; call attempt_reconnect on every rank"),
                                (again.message, "; call attempt_reconnect (0/2 ranks have)")]:
            assert message.startswith(f"world {world} epoch 1 failed: world {world}: xxx"), message[:300]
            said = f" ... (cut){note}" if code == NEWER_CODE else " ... (cut)"
            assert message.endswith(said + advice), message[-300:]
            assert len(message) <= proto.MAX_ERROR_TEXT - 96, len(message)  # (whole on the wire)
    finally:
        client.close()
        root.close()


def test_a_member_s_failure_with_a_code_the_root_lacks_fails_the_world_with_its_text(
        daemon: DaemonProcess) -> None:
    """A member X of a newer build fails a world rooted on B with an error code B does not
    know: B's rank must hear X's text, and B's link to X stay (before: the link was dropped,
    and the world failed with "daemon X was lost: bad frame: ...")."""
    member = RawPeer("X")
    world = world_name()
    rank0 = RawClient(str(daemon.socket_path), 10)
    try:
        hello(rank0, world, 0, daemon.peer_address())
        link = member.dial(daemon)
        member.send(link, p.JoinWorld(world, 2, 1, 0, 8000, vote=1))
        assert isinstance(rank0.recv(), proto.Welcome)
        wait_until(lambda: member.got(p.WorldReady, world=world), timeout=5)
        member.send_map(link, {"t": "world_failed", "world": world, "epoch": 1, "code": NEWER_CODE,
                               "message": f"world {world}: X's quota is spent"})
        event = rank0.recv()
        assert isinstance(event, proto.Event) and event.code is ErrorCode.WORLD_FAILED, event
        assert event.message.startswith(f"world {world}: X's quota is spent (code '{NEWER_CODE}' from "
                                        "daemon X"), event.message
        assert query_status(str(daemon.socket_path), 5)["peers"]["links"] == ["X"] and not member.lost
    finally:
        rank0.close()
        member.close()


@pytest.mark.parametrize(("newer_is", "change"), [("member", "features"), ("root", "features"),
                                                  ("member", "incarnation")],
                         ids=["member", "root", "member-incarnation"])
def test_a_daemon_of_another_peer_protocol_is_refused_at_once_naming_both(
        daemon: DaemonProcess, newer_is: str, change: str) -> None:
    """A daemon N of a newer build (the next peer protocol, its hello with a field this build
    lacks) and B, of this one, in one world. The one that dials is refused at once, in words
    that name both daemons and protocols, and B serves its other worlds (before, with N dialing:
    B could not read N's hello and closed without a word, which N took for a listener too busy
    to answer; it dialed 7 times over its handshake window, and the rank got PeerLost "the
    listener closed the connection before the handshake (closed by the peer): too many
    handshakes under way? (dialed 7 times in 1s)", B logging each as "peer_hello: unknown
    field 'features'"). So when its hello's incarnation has another form (32 bytes): WIRE.md
    promises only version, daemon and nonce keep theirs, yet B checked it and dropped the hello
    without a word ("an incarnation is 16 bytes"), the dialer again dialing for its window)."""
    tmp = short_tmpdir()
    newer = DaemonProcess(Path(tmp) / "N" / "commd.sock", env=SECRET, under=[*NEWER_BUILD, change], args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", "N", *FAST])
    try:
        newer.start()
        root, member = (daemon, newer) if newer_is == "member" else (newer, daemon)
        started = time.monotonic()
        with pytest.raises(PeerLost) as refused:
            DaemonBackend(str(member.socket_path), world_name(), 1, 2, timeout=5,
                          bootstrap=root.peer_address())
        assert time.monotonic() - started < 0.9  # (not dialing again for the 1 s handshake window)
        ours, theirs = (p.PEER_VERSION, "'B'"), (p.PEER_VERSION + 1, "'N'")
        dialer, listener = (theirs, ours) if newer_is == "member" else (ours, theirs)
        assert (f"cannot reach the daemon at {root.peer_address()}: peer protocol {dialer[0]} (daemon "
                f"{dialer[1]}) is not {listener[0]} (daemon {listener[1]}, commd {__version__}): daemons "
                "link at one peer protocol only") in str(refused.value)
        assert query_status(str(root.socket_path), 5)["peers"]["refused_handshakes"] == 1
        with RawClient(str(daemon.socket_path), 10) as alone:  # B serves on
            assert isinstance(alone.join(world_name()), proto.Welcome)
    finally:
        newer.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# What a build of this peer protocol may send that this one cannot read (a newer build that
# did not raise PEER_VERSION, or a bug), and what B says it could not read
UNREADABLE = {
    "unknown-type": ({"t": "world_paused", "epoch": 1}, "unknown message type 'world_paused'"),
    "unknown-field": ({"t": "world_failed", "epoch": 1, "code": "timeout", "message": "late", "hint": "x"},
                      "world_failed: unknown field 'hint'"),
}


def worlds_over_the_link_fail_saying(said: str, send: Callable[[RawPeer, Any, str], None],
                                     under: Sequence[str] = (),
                                     code: ErrorCode = ErrorCode.PEER_LOST) -> None:
    """Daemon B (run `under` a command) votes for two worlds at the raw root R, which forms
    both, then `send`s (given R, its link and the first world) what ends the link: both worlds
    must fail with `code` (PeerLost's) saying `said` (not that R was lost), B log it, and drop
    the link."""
    tmp = short_tmpdir()
    log_path = Path(tmp) / "daemon.log"
    root = RawPeer("R")
    worlds = [world_name() for _ in range(2)]
    try:
        with open(log_path, "wb") as log, DaemonProcess(
                Path(tmp) / "B" / "commd.sock", env=SECRET, log=log, under=under,
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B", *FAST]) as daemon:
            clients = [RawClient(str(daemon.socket_path), 10) for _ in worlds]
            try:
                link = voted_at(root, clients, worlds)
                for world in worlds:
                    root.send(link, p.WorldReady(world, 1, ("R", "B")))
                assert all(isinstance(client.recv(), proto.Welcome) for client in clients)
                send(root, link, worlds[0])
                for client in clients:
                    event = client.recv()
                    assert isinstance(event, proto.Event), event
                    assert event.kind is proto.EventKind.WORLD_FAILED and event.epoch == 1
                    assert event.code is code, event
                    assert event.message == said, event.message
                wait_until(lambda: said in log_path.read_text(errors="replace"), timeout=5)
                assert "was lost" not in log_path.read_text(errors="replace")
                assert query_status(str(daemon.socket_path), 5)["peers"]["links"] == []
            finally:
                for client in clients:
                    client.close()
    finally:
        root.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("frame", list(UNREADABLE))
def test_a_frame_this_build_cannot_read_fails_the_worlds_saying_so_not_that_the_daemon_was_lost(
        frame: str) -> None:
    """The root R, alive and of this peer protocol, sends a frame B cannot read. B drops the
    link (WIRE.md §9), and both worlds over it fail with PeerLost, but the ranks and B's log
    must say what happened and name this build (before: "daemon R was lost: bad frame: unknown
    message type 'world_paused'", as if R had died, and no word of either build)."""
    raw, unread = UNREADABLE[frame]
    worlds_over_the_link_fail_saying(
        f"daemon R sent a frame this build cannot read ({unread}); the link was dropped (peer "
        f"protocol {p.PEER_VERSION}, commd {__version__} here)",
        lambda root, link, world: root.send_map(link, {**raw, "world": world}))


def test_a_daemon_that_redials_with_a_frame_this_build_cannot_read_does_not_flood_the_log() -> None:
    """R dials B 300 times as fast as it can, each time sending one frame B cannot read after
    a good handshake: B must log that line at most once a second, counting the ones it left
    out, and every world be told as before (before: one line a dial, some 1000 lines a
    second here, each one dial and one handshake's cost)."""
    tmp = short_tmpdir()
    log_path = Path(tmp) / "daemon.log"
    root = RawPeer("R")
    said = "daemon R sent a frame this build cannot read (unknown message type 'world_paused')"
    try:
        with open(log_path, "wb") as log, DaemonProcess(
                Path(tmp) / "B" / "commd.sock", env=SECRET, log=log,
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B", *FAST]) as daemon:
            started = time.monotonic()
            for _ in range(300):
                root.send_map(root.dial(daemon), {"t": "world_paused", "epoch": 1})
            took = time.monotonic() - started
            time.sleep(1.1)  # (the next line, logged, counts what the last second left out)
            root.send_map(root.dial(daemon), {"t": "world_paused", "epoch": 1})

            def logged() -> list[str]:
                return [line for line in log_path.read_text(errors="replace").splitlines() if said in line]

            wait_until(lambda: sum(1 + int(m.group(1)) if (m := re.search(r"\((\d+) more like it", line))
                                   else 1 for line in logged()) == 301, timeout=10)
            assert len(logged()) <= took + 3, (len(logged()), took)
            assert query_status(str(daemon.socket_path), 5)["peers"]["links"] == []
    finally:
        root.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_link_dropped_right_after_another_daemons_is_logged_all_the_same() -> None:
    """R1 and then, 0.2 s later, R2 each send B a frame it cannot read: B drops both links,
    and its log must name both (before: the throttle that bounds one redialing daemon's
    lines, shared by every link, left R2's line out, and B logged no word of that link's
    end: only a later drop's line would have counted it, without its name)."""
    tmp = short_tmpdir()
    log_path = Path(tmp) / "daemon.log"
    peers = [RawPeer("R1"), RawPeer("R2")]
    try:
        with open(log_path, "wb") as log, DaemonProcess(
                Path(tmp) / "B" / "commd.sock", env=SECRET, log=log,
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B", *FAST]) as daemon:
            for peer in peers:
                peer.send_map(peer.dial(daemon), {"t": "world_paused", "epoch": 1})
                time.sleep(0.2)
            said = [f"daemon {name} sent a frame this build cannot read (unknown message type "
                    "'world_paused')" for name in ("R1", "R2")]
            wait_until(lambda: all(line in log_path.read_text(errors="replace") for line in said),
                       lambda: [line for line in said if line not in log_path.read_text(errors="replace")],
                       timeout=5)
    finally:
        for peer in peers:
            peer.close()
        shutil.rmtree(tmp, ignore_errors=True)


# Each message of a handshake, as R (with the secret) may send it on a link that has had its own
HANDSHAKE = [
    p.PeerHello(p.PEER_VERSION, "R", b"n" * p.NONCE_BYTES, b"i" * p.INCARNATION_BYTES),
    p.PeerChallenge("R", b"n" * p.NONCE_BYTES, b"p" * 32, b"i" * p.INCARNATION_BYTES),
    p.PeerProof(b"p" * 32), p.PeerReady(), p.PeerBusy("busy"), p.PeerRefused("no"),
]


@pytest.mark.parametrize("msg", HANDSHAKE, ids=[type(m).__name__ for m in HANDSHAKE])
def test_a_handshake_message_on_an_established_link_fails_the_worlds_saying_so(msg: p.PeerMessage) -> None:
    """The root R, alive, sends a message of the handshake on a link whose handshake ended: B
    drops the link, and its worlds must be told what R sent (before: "daemon R was lost: sent
    PeerHello after the handshake", as if R had died)."""
    worlds_over_the_link_fail_saying(
        f"daemon R sent a handshake message ({type(msg).__name__}) on an established link; the link "
        f"was dropped (peer protocol {p.PEER_VERSION}, commd {__version__} here)",
        lambda root, link, world: root.send(link, msg))


# `commd serve` with a bug planted where B handles a world_failed from another daemon (the
# command execs the daemon's, given as its last arguments: DaemonProcess's `under`)
BUGGY_BUILD = [sys.executable, "-c", """
import runpy, sys
from commd.registry import Registry

def planted(self, link, msg, payload):
    raise KeyError("planted")

Registry._world_failed = planted
sys.argv = ["commd", *sys.argv[4:]]
runpy.run_module("commd", run_name="__main__", alter_sys=True)
"""]


def test_a_daemons_own_error_handling_a_peer_frame_says_it_is_its_own_not_that_the_peer_was_lost() -> None:
    """B fails (a bug) handling the world_failed the root R sends for one world: B drops the
    link, and its worlds must be told that B failed, and how, not that R was lost (before:
    "daemon R was lost: internal error handling WorldFailed: KeyError('planted')"), nor by
    their code (before: peer_lost, a rank's PeerLost; now world_failed, a WorldFailed)."""
    worlds_over_the_link_fail_saying(
        f"daemon B failed handling WorldFailed from daemon R (KeyError('planted')), a bug in daemon B; "
        f"the link was dropped (peer protocol {p.PEER_VERSION}, commd {__version__} here)",
        lambda root, link, world: root.send(link, p.WorldFailed(world, 1, ErrorCode.TIMEOUT, "late")),
        under=BUGGY_BUILD, code=ErrorCode.WORLD_FAILED)


@pytest.mark.parametrize("newer_is", ["member", "root"])
def test_a_refusal_by_version_quotes_a_name_with_control_characters(newer_is: str) -> None:
    """The newer daemon's name has control characters (a terminal's escape, a bell, a line
    break): the refusal by version, which the rank reads and the listener logs, must quote it,
    as every other refusal of a hello does (before: "peer protocol 8 (daemon N<ESC>[2J<BEL>
    <LF>forged line) is not 7 ...", the characters as they are in the rank's text and the
    log, where the line break starts a line of the name's making)."""
    tmp = short_tmpdir()
    name = "N\x1b[2J\x07\nforged line"
    logs = {side: Path(tmp) / f"{side}.log" for side in "BN"}
    try:
        with open(logs["B"], "wb") as b_log, open(logs["N"], "wb") as n_log, DaemonProcess(
                Path(tmp) / "B" / "commd.sock", env=SECRET, log=b_log,
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B", *FAST]) as daemon, DaemonProcess(
                Path(tmp) / "N" / "commd.sock", env=SECRET, log=n_log, under=[*NEWER_BUILD, "features"],
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", name, *FAST]) as newer:
            root, member = (daemon, newer) if newer_is == "member" else (newer, daemon)
            with pytest.raises(PeerLost) as refused:
                DaemonBackend(str(member.socket_path), world_name(), 1, 2, timeout=5,
                              bootstrap=root.peer_address())
            ours, theirs = (p.PEER_VERSION, "'B'"), (p.PEER_VERSION + 1, repr(name))
            dialer, listener = (theirs, ours) if newer_is == "member" else (ours, theirs)
            said = (f"peer protocol {dialer[0]} (daemon {dialer[1]}) is not {listener[0]} (daemon "
                    f"{listener[1]}, commd {__version__}): daemons link at one peer protocol only")
            assert said in str(refused.value) and "\x1b" not in str(refused.value)
            listener_log = logs["B" if newer_is == "member" else "N"]
            wait_until(lambda: said in listener_log.read_text(errors="replace"), timeout=5)
            for log in logs.values():
                text = log.read_text(errors="replace")
                assert "\x1b" not in text and "\x07" not in text and "\nforged line" not in text, text
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
