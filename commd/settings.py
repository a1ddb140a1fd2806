"""Where the daemon's settings come from, in rising precedence: the TOML file
(`--config`, else /etc/commd/commd.toml if it exists), `COMMD_<KEY>` environment
variables, command-line flags. The result is the one frozen `ServerConfig`.

Every key has one name everywhere: `threads` in the file, `COMMD_THREADS` in the
environment, `--threads` on the command line. An unknown key, a value of the
wrong type or a bad value stops the daemon at start with an error that names
the key and where its value came from.

Secrets never sit in the config file (it tends to be world-readable): the file
may name `peer_secret_file`; the secret itself comes from that file, from
$COMMD_PEER_SECRET_FILE, or from $COMMD_PEER_SECRET.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import (
    DEFAULT_SOCKET,
    KEY_OF_FIELD,
    LIMITS,
    SECRET_ENV,
    ServerConfig,
    flag_of,
    located,
    read_secret_file,
    read_small_file,
    secret_of,
)
from .errors import ConfigError

DEFAULT_CONFIG = "/etc/commd/commd.toml"
MAX_CONFIG_BYTES = 1 << 20
ENV_PREFIX = "COMMD_"


# Each parser takes the value and whether it is text to convert (an environment
# variable) rather than a typed TOML or flag value, where a string is not a number.
Parser = Callable[[Any, bool], Any]


def _text(value: Any, text: bool = False) -> str:
    """Text the daemon shows or sends (a status report, a peer's handshake): UTF-8."""
    name = _name(value)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # (undecodable bytes of an environment variable)
        raise ValueError("it is not UTF-8 text") from None
    return name


def _name(value: Any, text: bool = False) -> str:
    """A file name: any bytes but NUL (a report shows it backslash-escaped)."""
    if not isinstance(value, str):
        raise TypeError("expected a string")
    if "\x00" in value:
        raise ValueError("it holds a NUL character")
    return value


def _int(value: Any, text: bool) -> int:
    if text and isinstance(value, str):
        return int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("expected an integer")
    return value


def _float(value: Any, text: bool) -> float:
    if text and isinstance(value, str):
        return float(value.strip())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("expected a number")
    return float(value)


def _list(item: Parser) -> Parser:
    """A list (TOML array, repeated flag, or comma-separated in the environment) of `item`s."""

    def parse(value: Any, text: bool) -> tuple[Any, ...]:
        if text and isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list | tuple):
            raise TypeError("expected a list")
        return tuple(item(v, text) for v in value)

    return parse


def _file(value: Any, text: bool = False) -> str:
    """A file's path: a name, and not empty (the system takes "" for "." or for no file)."""
    path = _name(value)
    if not path:
        raise ValueError("an empty path names no file")
    return path


def _path(value: Any, text: bool) -> Path:
    return Path(_file(value))


def _upper(value: Any, text: bool) -> str:
    return _text(value).upper()


def _address(value: Any, text: bool) -> tuple[str, int]:
    from .cluster import parse_address

    return parse_address(_text(value))


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    parse: Parser  # raises TypeError (wrong type) or ValueError (bad value)
    field: str | None  # the ServerConfig field it sets (None: handled by `_fields`)


KEYS: dict[str, Key] = {k.name: k for k in (
    Key("socket", _path, "socket_path"),
    Key("engine", _text, "engine"),
    Key("allow_uids", _list(_int), None),
    Key("allow_gids", _list(_int), None),
    Key("allow_groups", _list(_text), None),
    Key("threads", _int, "threads"),
    Key("log_level", _upper, "log_level"),
    Key("log_format", _text, "log_format"),
    Key("metrics_listen", _address, "metrics_listen"),
    Key("peer_listen", _address, "peer_listen"),
    Key("peer_name", _text, "peer_name"),
    Key("peer_secret_file", _file, None),
    Key("peer_heartbeat", _float, "peer_heartbeat_s"),
    Key("peer_window", _float, "peer_window_s"),
    Key("hello_timeout", _float, "hello_timeout_s"),
    Key("max_call_timeout", _float, "max_call_timeout_s"),
    *(Key(name, _int, name) for name in LIMITS),
)}
_FORBIDDEN_IN_FILE = {"peer_secret": "secrets never go in the config file; name a file "
                                     "with peer_secret_file (mode 0600, owned by commd)"}


@dataclass(frozen=True, slots=True)
class Value:
    raw: Any
    source: str  # "/etc/commd/commd.toml", "$COMMD_THREADS", "--threads"
    from_file: bool = False
    text: bool = False  # from the environment: a string to convert

    def where(self, name: str) -> str:
        return f"{name} = {self.raw!r} from {self.source}"


def load_config(flags: Mapping[str, Any], environ: Mapping[str, str],
                config_path: str | None) -> ServerConfig:
    """The effective configuration. `flags` are the command line's values by key name,
    None where a flag was not given."""
    values = _layered(flags, environ, config_path)
    parsed = {name: _parse(KEYS[name], value) for name, value in values.items()}
    sources = {name: value.where(name) for name, value in values.items()}
    try:
        return ServerConfig(**_fields(parsed, values, environ), sources=sources)
    except ConfigError as exc:
        raise _located(exc, values, environ, sources) from None


def socket_of(flags: Mapping[str, Any], environ: Mapping[str, str], config_path: str | None) -> Path:
    """The socket the daemon these settings start listens on: what `commd status` asks.
    Only the socket is read: a flag naming it needs no file, and the caller's environment
    may hold variables the daemon would refuse (a Kubernetes Service's $COMMD_SERVICE_HOST)."""
    own = ENV_PREFIX + "SOCKET"
    layers = flag_layer(flags) if flags.get("socket") is not None else _layered(
        flags, {own: environ[own]} if own in environ else {}, config_path)
    value = layers.get("socket")
    socket: Path = _parse(KEYS["socket"], value) if value is not None else Path(DEFAULT_SOCKET)
    return socket


def _layered(flags: Mapping[str, Any], environ: Mapping[str, str],
             config_path: str | None) -> dict[str, Value]:
    values: dict[str, Value] = {}
    path = config_path if config_path is not None else (
        DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    if path:
        values.update(file_layer(path))
    values.update(env_layer(environ))
    values.update(flag_layer(flags))
    return values


def file_layer(path: str) -> dict[str, Value]:
    try:
        table = tomllib.loads(read_small_file(path, MAX_CONFIG_BYTES, "config file").decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:  # (tomllib's parser recurses once per nested array or table)
        raise ConfigError(f"config file {path} nests arrays or tables too deeply") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
    for name in table:
        if name in _FORBIDDEN_IN_FILE:
            raise ConfigError(f"{name} (in {path}): {_FORBIDDEN_IN_FILE[name]}")
        if name not in KEYS:
            raise ConfigError(f"{name} (in {path}): unknown key{_known()}")
    return {name: Value(raw, path, from_file=True) for name, raw in table.items()}


def env_layer(environ: Mapping[str, str]) -> dict[str, Value]:
    out = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX) or var == SECRET_ENV:
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in KEYS or var != ENV_PREFIX + name.upper():
            raise ConfigError(f"${var}: unknown setting (the environment may set "
                              f"{ENV_PREFIX}<KEY> or {SECRET_ENV}){_known()}")
        out[name] = Value(raw, "$" + var, text=True)
    return out


def flag_layer(flags: Mapping[str, Any]) -> dict[str, Value]:
    return {name: Value(raw, flag_of(name))
            for name, raw in flags.items() if name in KEYS and raw is not None}


def _parse(key: Key, value: Value) -> Any:
    try:
        return key.parse(value.raw, value.text)
    except TypeError as exc:
        raise ConfigError(f"{key.name} (from {value.source}): {exc}, got {value.raw!r}") from None
    except ValueError as exc:
        raise ConfigError(f"{key.name} (from {value.source}): bad value {value.raw!r}: {exc}") from None


def _fields(parsed: dict[str, Any], values: dict[str, Value],
            environ: Mapping[str, str]) -> dict[str, Any]:
    out = {key.field: parsed[name] for name, key in KEYS.items()
           if key.field is not None and name in parsed}
    out.setdefault("socket_path", Path(DEFAULT_SOCKET))
    # own uid and root may always connect (root could anyway; the daemon's own tools must)
    out["allow_uids"] = frozenset({os.getuid(), 0, *parsed.get("allow_uids", ())})
    out["allow_gids"] = frozenset(parsed.get("allow_gids", ())) | _group_ids(
        parsed.get("allow_groups", ()), values.get("allow_groups"))
    out["peer_secret"] = _secret(parsed.get("peer_secret_file"), values.get("peer_secret_file"),
                                 environ)
    return out


def _secret(path: str | None, value: Value | None, environ: Mapping[str, str]) -> bytes | None:
    if _secret_from_env(value, environ):
        return secret_of(os.fsencode(environ[SECRET_ENV]))  # (its bytes, UTF-8 or not)
    return read_secret_file(path) if path else None


def _secret_from_env(value: Value | None, environ: Mapping[str, str]) -> bool:
    """Whether $COMMD_PEER_SECRET gives the secret: a secret file named by a flag or the
    environment beats it, and it beats one named in the config file (the environment
    overrides the file)."""
    return bool(environ.get(SECRET_ENV)) and (value is None or value.from_file)


def _group_ids(names: tuple[str, ...], value: Value | None) -> frozenset[int]:
    import grp

    gids = set()
    for name in names:
        try:
            gids.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            where = f" (from {value.source})" if value is not None else ""
            raise ConfigError(f"allow_groups{where}: no group named {name!r}") from None
    return frozenset(gids)


def _located(exc: ConfigError, values: dict[str, Value], environ: Mapping[str, str],
             sources: Mapping[str, str]) -> ConfigError:
    """`exc`, saying where the value it names came from."""
    name = KEY_OF_FIELD.get(exc.key or "", exc.key or "")
    # (the variable may have beaten a file the config names: that file is not to blame)
    if name == "peer_secret_file" and _secret_from_env(values.get(name), environ):
        return ConfigError(f"{exc} (from ${SECRET_ENV})", key=name)
    return located(exc, sources)


def _known() -> str:
    return "; known keys: " + ", ".join(KEYS)
