"""`commd` command line: serve, status, demo, bench."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import proto
from client.errors import CommError, ProtocolError

from . import build_line
from .config import (
    DEFAULT_SOCKET,
    ENGINES,
    LIMITS,
    LOG_FORMATS,
    LOG_LEVELS,
    SECRET_ENV,
    SECRET_FILE_ENV,
    ServerConfig,
    flag_of,
    located,
)
from .errors import ConfigError
from .logs import flush_logs, print_last, setup_logging, write_stderr


def _serve(args: argparse.Namespace) -> int:
    from .daemon import run
    from .settings import load_config

    config = load_config(vars(args), os.environ, args.config)
    setup_logging(config.log_level, config.log_format)
    try:
        return run(config)
    except ConfigError as exc:
        raise located(exc, config.sources) from None
    finally:
        flush_logs()  # (the lines kept for a stalled stderr, before main's final error, if any)


def _status(args: argparse.Namespace) -> int:
    from .settings import socket_of
    from .status import query_status, render_status

    if args.world is not None:
        _check_world_name(args.world)
    # (the daemon's own settings say where it listens; a systemd unit may set them)
    socket = socket_of({"socket": args.socket}, os.environ, args.config)
    info = query_status(str(socket), args.timeout, args.world)
    try:
        # one world asked for: its whole flight recorder as sent (the last 8 calls per rank)
        report = (json.dumps(info, indent=2, allow_nan=False) if args.json
                  else render_status(info, 8 if args.world else 1))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a daemon of another version?
        raise ProtocolError(f"the daemon's status report is not what this commd reads: "
                            f"{type(exc).__name__}: {exc}") from None
    try:
        print(report, flush=True)
    except OSError as exc:
        # (the interpreter's last flush would meet the same stdout again, and say so)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if isinstance(exc, BrokenPipeError):  # the reader went away (`commd status | head`)
            return 141  # as a command that SIGPIPE ended: nobody to tell
        # (a full disk: say so, the report cannot be had otherwise)
        print(f"commd: cannot write the status report: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _check_world_name(name: str) -> None:
    try:
        proto.StatusQuery(1, name)
        name.encode("utf-8")
    except proto.InvalidMessage as exc:
        raise ConfigError(f"--world: {exc}") from None
    except UnicodeError:  # (undecodable bytes on the command line)
        raise ConfigError("--world: not UTF-8 text") from None


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def _seconds(text: str) -> float:
    """A --timeout: finite, positive, at most a day (nan, inf and 1e30 broke the calls)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise argparse.ArgumentTypeError("must be seconds, 0 < t <= 86400")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse writes its usage and error to stderr with plain writes, which wait for a
    stalled reader for ever (`commd serve --bogus` under a journal that does not read):
    they go out as the daemon's last words do, in one write. Its subcommands' parsers
    are of this class too (add_subparsers makes them of the parent's)."""

    def error(self, message: str) -> NoReturn:
        write_stderr(f"{self.format_usage()}{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="commd", description=__doc__)
    # (an operator checks before an upgrade which protocols a build speaks: README "Upgrading")
    parser.add_argument("--version", action="version", version=build_line())
    sub = parser.add_subparsers(dest="command", required=True)

    # Every flag defaults to None ("not given"), so the config file and COMMD_* variables
    # show through; the defaults live in ServerConfig. dest= is the config key's name.
    serve = sub.add_parser("serve", help="run the daemon",
                           epilog="Settings: the config file, then COMMD_<KEY> variables, then "
                                  "these flags, each overriding the one before (see deploy/commd.toml).")
    serve.add_argument("--config", default=None, metavar="PATH",
                       help="TOML config file (default: /etc/commd/commd.toml if it exists)")
    serve.add_argument("--socket", metavar="PATH", help=f"Unix socket path ({DEFAULT_SOCKET})")
    serve.add_argument("--engine", choices=ENGINES, help="host by default")
    serve.add_argument(flag_of("allow_uids"), dest="allow_uids", type=int, action="append", metavar="N",
                       help="also admit this uid (repeatable; own uid and root always)")
    serve.add_argument(flag_of("allow_gids"), dest="allow_gids", type=int, action="append", metavar="N",
                       help="admit members of this gid (repeatable)")
    serve.add_argument(flag_of("allow_groups"), dest="allow_groups", action="append", metavar="NAME",
                       help="admit members of this group, by name (repeatable)")
    serve.add_argument("--threads", type=int, metavar="N",
                       help="host engine threads (default: the cores, at most 8)")
    serve.add_argument("--peer-listen", metavar="HOST:PORT",
                       help="accept other daemons here (worlds across nodes; needs a secret)")
    serve.add_argument("--peer-name", metavar="NAME", help="this daemon's name among its peers "
                       "(default: hostname:port, or hostname:SOCKET without a fixed port)")
    serve.add_argument("--peer-secret-file", metavar="PATH",
                       help=f"the shared secret (or ${SECRET_FILE_ENV} / ${SECRET_ENV})")
    serve.add_argument("--peer-heartbeat", type=float, metavar="SECONDS", help="0.5 by default")
    serve.add_argument("--peer-window", type=float, metavar="SECONDS",
                       help="a peer silent this long is lost (3.0 by default)")
    serve.add_argument("--hello-timeout", type=float, metavar="SECONDS",
                       help="a connection that says nothing this long is closed (10 by default)")
    serve.add_argument("--max-call-timeout", type=float, metavar="SECONDS",
                       help="a call open longer fails its world, whatever timeout its ranks "
                            "ask for (default: theirs)")
    for limit in LIMITS:
        serve.add_argument(flag_of(limit), type=int, metavar="N",
                           help=f"a limit ({ServerConfig.__dataclass_fields__[limit].default} by default)")
    # (any case, as the config file and the environment take it)
    serve.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="INFO by default")
    serve.add_argument("--log-format", choices=LOG_FORMATS, help="text (default) or json lines")
    serve.add_argument(flag_of("metrics_listen"), dest="metrics_listen", metavar="HOST:PORT",
                       help="serve Prometheus metrics at http://HOST:PORT/metrics (off by default)")
    serve.set_defaults(func=_serve)

    status = sub.add_parser("status", help="ask a running daemon what it is doing")
    status.add_argument("--config", default=None, metavar="PATH",
                        help="the daemon's TOML config file, for its socket "
                             "(default: /etc/commd/commd.toml if it exists)")
    status.add_argument("--socket", metavar="PATH",
                        help=f"the daemon's Unix socket (default: $COMMD_SOCKET, else the config's, "
                             f"else {DEFAULT_SOCKET})")
    status.add_argument("--json", action="store_true",
                        help="everything, as JSON (with the effective configuration)")
    status.add_argument("--world", default=None, metavar="NAME",
                        help="only this world, with its last 8 calls per rank")
    status.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS",
                        help="how long to wait for the daemon's answer (5 by default)")
    status.set_defaults(func=_status)

    demo = sub.add_parser("demo", help="a tensor-parallel decode loop through the daemon")
    demo.add_argument("--ranks", type=int, default=4, help="worker processes, 1..64 (4 by default)")
    demo.add_argument("--steps", type=int, default=200,
                      help="decode steps, each a command broadcast from rank 0 (200 by default)")
    demo.add_argument("--layers", type=int, default=8,
                      help="all_reduces of the activation per step (8 by default)")
    demo.add_argument("--hidden", type=int, default=4096,
                      help="bf16 elements per activation (4096 by default)")
    demo.add_argument("--timeout", type=_seconds, default=60.0, metavar="SECONDS",
                      help="each call's timeout, and how long the run may go without a worker's word "
                           "(60 by default)")
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
                       help="pin the worker processes to CPUs (the daemon is not pinned)")
    bench.add_argument("--daemons", type=int, default=1,
                       help="commd side: spread each world over this many daemons on this host "
                            "(ranks in contiguous blocks; rank 0's daemon is the root)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except ConfigError as exc:
        print_last(f"commd: configuration error: {exc}")
        return 2
    except CommError as exc:
        print_last(f"commd: {type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:  # (Ctrl-C: the user knows why; a traceback would bury that it took)
        print_last("commd: interrupted")
        return 130
