"""Run the daemon: engine, server, signals, clean exit."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import inspect
import logging
import os
import resource
import signal
import socket
from collections.abc import Callable, MutableMapping

from proto.peer import MAX_DAEMON_NAME

from .cluster import Cluster
from .config import ServerConfig, utf8_text
from .engine import create_engine
from .engine.base import Engine
from .errors import ConfigError
from .peerlink import PeerSettings
from .server import Server
from .systemd import Notifier, inherited_listener, keep_alive, watchdog_interval

log = logging.getLogger("commd")


ENGINE_CHECK_S = 0.5  # how often the engine is asked whether its GPU is still usable
# How long a stop waits for the other daemons to take what is queued for them (the world
# failures that say why come last): a daemon that does not read by then hears only a lost link
PEER_FAREWELL_S = 1.0


# SIGHUP too: commd has no reload, and the default action of a hang-up killed it with no
# teardown (socket file left, ranks not told, and a death systemd does not restart)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def serve(config: ServerConfig, ready: asyncio.Event | None = None,
                environ: MutableMapping[str, str] | None = None, engine: Engine | None = None,
                *, ignore_signals_after: bool = False) -> int:
    """Serve until SIGTERM, SIGINT or SIGHUP; then fail pending calls, remove the socket, return 0.
    Return 1 instead when the engine broke for good (a sticky CUDA error): the service
    manager starts the daemon afresh (Restart=on-failure), which is the only recovery.

    `environ` (os.environ by default) carries what systemd passes: $NOTIFY_SOCKET,
    $WATCHDOG_USEC, and the LISTEN_* variables of socket activation (removed once read).
    `engine`: the one to serve with, instead of the configured one (tests).
    `ignore_signals_after`: leave the stop signals ignored on the way out, not as they
    were (see run)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # Python-level handlers (the loop wakes for them), not loop.add_signal_handler: taking
    # those back goes through the default action for a moment, which kills (see run)
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda _signum, _frame: loop.call_soon_threadsafe(stop.set))
    try:
        return await _serve_until(stop, config, ready, os.environ if environ is None else environ, engine)
    finally:  # (last: a signal from here on meets the handler put back)
        for sig, handler in before.items():
            signal.signal(sig, signal.SIG_IGN if ignore_signals_after or handler is None else handler)


async def _serve_until(stop: asyncio.Event, config: ServerConfig, ready: asyncio.Event | None,
                       environ: MutableMapping[str, str], engine: Engine | None) -> int:
    loop = asyncio.get_running_loop()
    notifier = Notifier.from_env(environ)
    watchdog_s = watchdog_interval(environ, os.getpid())
    inherited = inherited_listener(environ, os.getpid())
    engine = engine if engine is not None else create_engine(config.engine, threads=config.threads)
    broke: list[str] = []
    cluster = _cluster(config)
    if cluster is not None:
        engine.on_loop_stall(cluster.announce_quiet)
    server = Server(config, engine, cluster)
    metrics: asyncio.Server | None = None
    alive: asyncio.Task[None] | None = None
    try:
        # Clients come last: one connecting as soon as the socket exists must find the daemon
        # whole (its status naming the metrics address, say), not half set up.
        if cluster is not None and config.peer_listen is not None:
            await cluster.listen(*config.peer_listen)
        if config.metrics_listen is not None:
            metrics = await _metrics(server, *config.metrics_listen)
        server.start(inherited)
        _tune_gc()
        _tune_malloc()
        # Only now: the socket accepts and the peer port listens, so clients that systemd
        # starts "After=commd.service" find the daemon serving.
        notifier.notify("READY=1", "STATUS=" + server.status_line())
        if notifier.enabled:
            alive = loop.create_task(keep_alive(notifier, watchdog_s, server.status_line))
        watch = loop.create_task(_watch_engine(engine, stop, broke))
        if ready is not None:
            ready.set()
        await stop.wait()
        watch.cancel()
        log.info("stopping")
    finally:
        await _tear_down([
            lambda: notifier.notify("STOPPING=1", "STATUS=stopping"),
            *([alive.cancel] if alive is not None else []),
            *([metrics.close] if metrics is not None else []),
            server.shutdown,
            *([lambda: cluster.farewell(PEER_FAREWELL_S)] if cluster is not None else []),
            notifier.close,
        ])
    return 1 if broke else 0


async def _tear_down(steps: list[Callable[[], object]]) -> None:
    """Take every step (awaiting those that return an awaitable), each though one before it
    raised: a shutdown that failed half-way must still bid the other daemons farewell (or
    they take it for lost) and close the rest. Then raise the first error; the later ones
    are logged."""
    first: BaseException | None = None
    for step in steps:
        try:
            done = step()
            if inspect.isawaitable(done):
                await done
        except BaseException as exc:  # (a cancel too: the steps after it still run)
            if first is None:
                first = exc
            else:
                log.error("stopping: a later step failed too", exc_info=exc)
    if first is not None:
        raise first


async def _watch_engine(engine: Engine, stop: asyncio.Event, broke: list[str]) -> None:
    while not stop.is_set():
        why = engine.broken()
        if why is not None:
            log.critical("the engine can serve no more (%s): exiting, for the service manager "
                         "to start the daemon afresh", why)
            broke.append(why)
            stop.set()
            return
        await asyncio.sleep(ENGINE_CHECK_S)


async def _metrics(server: Server, host: str, port: int) -> asyncio.Server:
    from .metrics import bound_address, renderer, serve_metrics

    metrics = await serve_metrics(host, port, renderer(server))
    server.metrics_address = bound_address(metrics)
    log.info("metrics on http://%s/metrics", server.metrics_address)
    return metrics


def _cluster(config: ServerConfig) -> Cluster | None:
    """The peer side, when a secret is configured (dialing a root needs it, listening too)."""
    if config.peer_secret is None:
        return None
    name = config.peer_name or default_peer_name(config, socket.gethostname())
    if len(name) > MAX_DAEMON_NAME:  # (a set peer_name was checked with the settings)
        raise ConfigError(f"peer_name: the default, {name[:60]}..., is {len(name)} characters; the peer "
                          f"protocol carries at most {MAX_DAEMON_NAME}: set peer_name", key="peer_name")
    return Cluster(PeerSettings(name, config.peer_secret, config.peer_heartbeat_s, config.peer_window_s),
                   config.max_peer_held_bytes)


def default_peer_name(config: ServerConfig, host: str) -> str:
    """host:port, or host:socket-path for a daemon without a fixed peer port: stable
    across restarts (the root then knows a restarted daemon for what it is, and ends
    the old process's links at once), and unique on the host (one daemon per socket).
    UTF-8 whatever the path's bytes: the handshake carries it as text."""
    port = config.peer_listen[1] if config.peer_listen else 0
    return utf8_text(f"{host}:{port}" if port else f"{host}:{os.fspath(config.socket_path)}")


def _tune_gc() -> None:
    """Latency: each call allocates a few dozen short-lived objects, so the default
    young-generation threshold (700) runs a collection every ~20 calls. Freeze what
    start-up built and collect young objects less often; reference counting frees
    almost everything anyway."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _tune_malloc() -> None:
    """Keep freed buffers for reuse. Every chunk a big op moves is a fresh multi-MiB
    buffer; glibc maps each from the kernel and unmaps it after, so every byte costs a
    page fault (measured: 40% of the daemons' system time on a 64 MiB all_reduce across
    two daemons). Serve them from the heap instead, and keep the heap's free memory: the
    daemon's footprint stays at its busiest, which is what it will need again."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: its allocator decides
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value
    libc.mallopt(m_trim_threshold, 1 << 30)


def _raise_fd_limit() -> None:
    """Every buffer the daemon maps holds an fd (the mmap's), every client and peer link one
    more: a shell's soft limit of 1024 would refuse imports (LimitExceeded) long before the
    configured limits do. Take the hard limit, as the unit's LimitNOFILE does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # (a hard limit of "unlimited" is no soft one's)
        log.warning("open files: cannot raise the soft limit %d to %s: %s", soft, hard, exc)
        return
    log.info("open files: soft limit raised from %d to %d", soft, hard)


def run(config: ServerConfig) -> int:
    """The daemon process: `serve` on uvloop. A signal once the stop is under way is
    ignored: the default action would kill the rest of the teardown (the loop's, the
    interpreter's) with exit -15."""
    import uvloop

    _raise_fd_limit()
    return uvloop.run(serve(config, ignore_signals_after=True))
