"""`commd` command line: serve, status, demo, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from client.errors import CommError

from .config import DEFAULT_SOCKET, ENGINES, SECRET_ENV, SECRET_FILE_ENV, ServerConfig, read_secret
from .errors import ConfigError


def _serve(args: argparse.Namespace) -> int:
    from .daemon import run

    config = ServerConfig(
        socket_path=Path(args.socket),
        engine=args.engine,
        allow_uids=frozenset({os.getuid(), 0, *args.allow_uid}),
        allow_gids=frozenset(args.allow_gid) | _group_ids(args.allow_group),
        threads=args.threads,
        log_level=args.log_level,
        peer_listen=_address(args.peer_listen) if args.peer_listen else None,
        peer_name=args.peer_name,
        peer_secret=read_secret(args.peer_secret_file, dict(os.environ)),
        peer_heartbeat_s=args.peer_heartbeat,
        peer_window_s=args.peer_window,
        **{name: value for name, value in vars(args).items() if name in _LIMITS and value is not None},
    )
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(config)


_LIMITS = ("max_connections", "max_buffers", "max_registrations", "max_queued_replies",
           "max_pending_ops")


def _address(text: str) -> tuple[str, int]:
    from .cluster import parse_address

    try:
        return parse_address(text)
    except ValueError as exc:
        raise ConfigError(f"peer-listen: {exc}") from None


def _group_ids(names: list[str]) -> frozenset[int]:
    import grp

    gids = set()
    for name in names:
        try:
            gids.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            raise ConfigError(f"allow-group: no group named {name!r}") from None
    return frozenset(gids)


def _status(args: argparse.Namespace) -> int:
    from .status import query_status, render_status

    info = query_status(args.socket, args.timeout, args.world)
    print(json.dumps(info, indent=2) if args.json else render_status(info))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--socket", default=DEFAULT_SOCKET, help="Unix socket path")
    serve.add_argument("--engine", default="host", choices=ENGINES)
    serve.add_argument("--allow-uid", type=int, action="append", default=[],
                       help="also admit this uid (repeatable; own uid and root always)")
    serve.add_argument("--allow-gid", type=int, action="append", default=[],
                       help="admit members of this gid (repeatable)")
    serve.add_argument("--allow-group", action="append", default=[],
                       help="admit members of this group, by name (repeatable)")
    serve.add_argument("--threads", type=int, default=None, help="host engine threads")
    serve.add_argument("--peer-listen", default=None, metavar="HOST:PORT",
                       help="accept other daemons here (worlds across nodes; needs a secret)")
    serve.add_argument("--peer-name", default=None,
                       help="this daemon's name among its peers (default: hostname:port)")
    serve.add_argument("--peer-secret-file", default=None, metavar="PATH",
                       help=f"the shared secret (or ${SECRET_FILE_ENV} / ${SECRET_ENV})")
    serve.add_argument("--peer-heartbeat", type=float, default=0.5, metavar="SECONDS")
    serve.add_argument("--peer-window", type=float, default=3.0, metavar="SECONDS",
                       help="a peer silent this long is lost")
    for limit in _LIMITS:
        serve.add_argument("--" + limit.replace("_", "-"), type=int, default=None, metavar="N",
                           help=f"limit ({ServerConfig.__dataclass_fields__[limit].default} by default)")
    serve.add_argument("--log-level", default="INFO",
                       choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    serve.set_defaults(func=_serve)

    status = sub.add_parser("status", help="ask a running daemon what it is doing")
    status.add_argument("--socket", default=DEFAULT_SOCKET)
    status.add_argument("--json", action="store_true")
    status.add_argument("--world", default=None, help="only this world")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(func=_status)

    demo = sub.add_parser("demo", help="a tensor-parallel decode loop through the daemon")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--hidden", type=int, default=4096, help="bf16 elements per activation")
    demo.add_argument("--timeout", type=float, default=60.0)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="DaemonBackend against torch.distributed gloo")
    bench.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    bench.add_argument("--sizes", default="8,65536,1048576,16777216,67108864",
                       help="comma-separated all_reduce sizes in bytes")
    bench.add_argument("--iters", type=int, default=0,
                       help="iterations per size (0: chosen by size)")
    bench.add_argument("--json", default="bench.json", help="where to write the results")
    bench.add_argument("--no-gloo", action="store_true", help="skip the gloo side")
    bench.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                       help="pin the daemon and workers to CPUs")
    bench.add_argument("--daemons", type=int, default=1,
                       help="commd side: spread each world over this many daemons on this host "
                            "(ranks in contiguous blocks; rank 0's daemon is the root)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"commd: configuration error: {exc}", file=sys.stderr)
        return 2
    except CommError as exc:
        print(f"commd: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
