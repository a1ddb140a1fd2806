"""Configuration layers: file < COMMD_<KEY> < flags, and every kind of error."""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import Any

import pytest

from commd.cli import build_parser
from commd.config import ServerConfig
from commd.errors import ConfigError
from commd.settings import KEYS, load_config

pytestmark = pytest.mark.timeout(10)


def flags(*argv: str) -> dict[str, Any]:
    """The serve parser's values, as the CLI hands them to load_config."""
    return vars(build_parser().parse_args(["serve", *argv]))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "commd.toml"
    path.write_text(text)
    return str(path)


def test_no_file_no_env_no_flags_gives_the_defaults() -> None:
    config = load_config(flags(), {}, "")
    assert config == ServerConfig(Path("/run/commd/commd.sock"))


def test_file_sets_values(tmp_path: Path) -> None:
    path = write(tmp_path, 'socket = "/tmp/x/c.sock"\nthreads = 3\npeer_heartbeat = 1\n'
                           'allow_uids = [1234]\nlog_format = "json"\nmetrics_listen = "127.0.0.1:9420"\n')
    config = load_config(flags(), {}, path)
    assert config.socket_path == Path("/tmp/x/c.sock")
    assert config.threads == 3
    assert config.peer_heartbeat_s == 1.0
    assert config.allow_uids == frozenset({1234, os.getuid(), 0})
    assert config.log_format == "json"
    assert config.metrics_listen == ("127.0.0.1", 9420)


@pytest.mark.parametrize("key", ["threads", "max_buffers", "log_level", "socket", "allow_gids",
                                 "max_call_timeout"])
def test_each_layer_overrides_the_one_below(tmp_path: Path, key: str) -> None:
    values = {"threads": ("2", "3", "4"), "max_buffers": ("10", "20", "30"),
              "log_level": ('"error"', "warning", "debug"), "socket": ('"/tmp/a"', "/tmp/b", "/tmp/c"),
              "allow_gids": ("[5]", "6,7", "8"), "max_call_timeout": ("5", "6.5", "7")}[key]
    field = {"socket": "socket_path", "max_call_timeout": "max_call_timeout_s"}.get(key, key)
    path = write(tmp_path, f"{key} = {values[0]}\n")
    env = {f"COMMD_{key.upper()}": values[1]}
    flag = ["--" + {"allow_gids": "allow-gid"}.get(key, key.replace("_", "-")), values[2]]

    def effective(config: ServerConfig) -> Any:
        value = getattr(config, field)
        return str(value) if key == "socket" else sorted(value) if key == "allow_gids" else value

    only_file = effective(load_config(flags(), {}, path))
    file_env = effective(load_config(flags(), env, path))
    all_three = effective(load_config(flags(*flag), env, path))
    expected = {"threads": (2, 3, 4), "max_buffers": (10, 20, 30),
                "log_level": ("ERROR", "WARNING", "DEBUG"), "socket": ("/tmp/a", "/tmp/b", "/tmp/c"),
                "allow_gids": ([5], [6, 7], [8]), "max_call_timeout": (5.0, 6.5, 7.0)}[key]
    assert (only_file, file_env, all_three) == expected


def test_allow_groups_by_name_from_env() -> None:
    name = grp.getgrgid(os.getgid()).gr_name
    config = load_config(flags(), {"COMMD_ALLOW_GROUPS": name}, "")
    assert os.getgid() in config.allow_gids


def test_secret_precedence(tmp_path: Path) -> None:
    in_file, in_env_file = tmp_path / "a.secret", tmp_path / "b.secret"
    in_file.write_text("secret-from-the-config-file\n")
    in_env_file.write_text("secret-from-the-env-file\n")
    path = write(tmp_path, f'peer_secret_file = "{in_file}"\n')
    assert load_config(flags(), {}, path).peer_secret == b"secret-from-the-config-file"
    # the environment overrides the file, whichever way it gives the secret
    assert load_config(flags(), {"COMMD_PEER_SECRET": "secret-from-the-environment"},
                       path).peer_secret == b"secret-from-the-environment"
    assert load_config(flags(), {"COMMD_PEER_SECRET_FILE": str(in_env_file)},
                       path).peer_secret == b"secret-from-the-env-file"
    assert load_config(flags("--peer-secret-file", str(in_file)),
                       {"COMMD_PEER_SECRET": "secret-from-the-environment"},
                       "").peer_secret == b"secret-from-the-config-file"


def test_every_key_has_an_env_variable() -> None:
    free_text = {"socket": "socket_path", "peer_name": "peer_name"}
    for name in KEYS:
        env = {f"COMMD_{name.upper()}": "[not a value]"}
        if name in free_text:
            assert str(getattr(load_config(flags(), env, ""), free_text[name])) == "[not a value]"
            continue
        with pytest.raises(ConfigError) as err:  # a value the key refuses: it says so by name
            load_config(flags(), env, "")
        assert name in str(err.value) and f"$COMMD_{name.upper()}" in str(err.value)


def error(tmp_path: Path, text: str | None = None, env: dict[str, str] | None = None,
          argv: tuple[str, ...] = ()) -> str:
    path = write(tmp_path, text) if text is not None else ""
    with pytest.raises(ConfigError) as err:
        load_config(flags(*argv), env or {}, path)
    return str(err.value)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    message = error(tmp_path, "threads = 2\nthread_count = 4\n")
    assert "thread_count" in message and "commd.toml" in message and "unknown key" in message


def test_unknown_env_variable() -> None:
    message = error(Path("/nonexistent"), env={"COMMD_THREAD_COUNT": "4"})
    assert "$COMMD_THREAD_COUNT" in message and "unknown setting" in message


def test_lower_case_env_variable_is_unknown() -> None:
    assert "$COMMD_threads" in error(Path("/nonexistent"), env={"COMMD_threads": "4"})


def test_existing_secret_variables_are_known() -> None:
    config = load_config(flags(), {"COMMD_PEER_SECRET": "0123456789abcdef"}, "")
    assert config.peer_secret == b"0123456789abcdef"


def test_secret_in_file_is_refused(tmp_path: Path) -> None:
    message = error(tmp_path, 'peer_secret = "0123456789abcdef"\n')
    assert "peer_secret" in message and "peer_secret_file" in message


@pytest.mark.parametrize(("text", "words"), [
    ('threads = "four"\n', ["threads", "expected an integer", "'four'"]),
    ("threads = true\n", ["threads", "expected an integer"]),
    ("engine = 3\n", ["engine", "expected a string"]),
    ("allow_uids = 5\n", ["allow_uids", "expected a list"]),
    ('peer_window = "long"\n', ["peer_window", "expected a number"]),
])
def test_wrong_type_in_file(tmp_path: Path, text: str, words: list[str]) -> None:
    message = error(tmp_path, text)
    assert all(w in message for w in words), message
    assert "commd.toml" in message


@pytest.mark.parametrize(("text", "env", "argv", "words"), [
    ("threads = 0\n", {}, (), ["threads", "1..256", "commd.toml"]),
    ("", {"COMMD_THREADS": "x"}, (), ["threads", "$COMMD_THREADS", "bad value"]),
    ("", {}, ("--threads", "999"), ["threads", "--threads", "999"]),
    ('engine = "nccl2"\n', {}, (), ["engine", "'nccl2'", "commd.toml"]),
    ('log_format = "xml"\n', {}, (), ["log_format", "commd.toml"]),
    ("", {"COMMD_LOG_LEVEL": "LOUD"}, (), ["log_level", "$COMMD_LOG_LEVEL"]),
    ("", {"COMMD_MAX_BUFFERS": "0"}, (), ["max_buffers", "must be 1..", "$COMMD_MAX_BUFFERS"]),
    ('metrics_listen = "localhost"\n', {}, (), ["metrics_listen", "HOST:PORT", "commd.toml"]),
    ("", {"COMMD_PEER_LISTEN": "127.0.0.1:99999"}, (), ["peer_listen", "$COMMD_PEER_LISTEN", "port"]),
    ("", {"COMMD_PEER_LISTEN": "127.0.0.1:7420"}, (), ["peer_listen", "secret"]),
    ("peer_window = 0.2\n", {}, (), ["peer_window", "heartbeat", "commd.toml"]),
    ("", {"COMMD_PEER_HEARTBEAT": "nan"}, (), ["peer_heartbeat", "finite", "$COMMD_PEER_HEARTBEAT"]),
    ("peer_heartbeat = 1e-9\n", {}, (), ["peer_heartbeat", "at least 0.01s", "commd.toml"]),
    ("", {}, ("--hello-timeout", "1e-6"), ["hello_timeout", "at least 0.01s", "--hello-timeout"]),
    ("peer_window = inf\n", {}, (), ["peer_window", "finite", "commd.toml"]),
    ("max_call_timeout = 0\n", {}, (), ["max_call_timeout", "positive", "commd.toml"]),
    ("", {"COMMD_MAX_CALL_TIMEOUT": "inf"}, (), ["max_call_timeout", "finite", "$COMMD_MAX_CALL_TIMEOUT"]),
    ("", {}, ("--max-call-timeout", "nan"), ["max_call_timeout", "--max-call-timeout"]),
    ('allow_groups = ["no-such-group-xyz"]\n', {}, (), ["allow_groups", "no-such-group-xyz"]),
    ('peer_secret_file = "/nonexistent/s"\n', {}, (), ["peer secret file", "/nonexistent/s"]),
    ("", {"COMMD_PEER_SECRET": "short"}, (), ["at least 16 bytes", "$COMMD_PEER_SECRET"]),
])
def test_bad_values_name_key_and_source(tmp_path: Path, text: str, env: dict[str, str],
                                         argv: tuple[str, ...], words: list[str]) -> None:
    message = error(tmp_path, text, env, argv)
    assert all(w in message for w in words), message


def test_a_file_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    message = error(tmp_path, "threads = " + "[" * 2000 + "]" * 2000 + "\n")
    assert "nests arrays or tables too deeply" in message and "commd.toml" in message, message


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(flags(), {}, str(tmp_path / "nope.toml"))


def test_unparseable_toml(tmp_path: Path) -> None:
    message = error(tmp_path, "threads = = 2\n")
    assert "not valid TOML" in message and "commd.toml" in message and "line 1" in message


def test_public_view_hides_the_secret() -> None:
    view = load_config(flags(), {"COMMD_PEER_SECRET": "0123456789abcdef"}, "").public()
    assert view["peer_secret_set"] is True
    assert "0123456789abcdef" not in repr(view)
    assert view["socket"] == "/run/commd/commd.sock" and view["peer_heartbeat"] == 0.5


def test_neither_config_shows_the_secret_when_printed() -> None:
    """ServerConfig hid it; the PeerSettings made from it printed it (in a traceback's
    locals, a debug line, an exception's repr)."""
    from commd.peerlink import PeerSettings

    secret = b"0123456789abcdef"
    config = ServerConfig(Path("/run/a.sock"), peer_listen=("0.0.0.0", 7420), peer_secret=secret)
    for printed in (repr(config), repr(PeerSettings("node1:7420", secret))):
        assert "0123456789abcdef" not in printed and "secret=" not in printed, printed


def test_default_peer_name_is_stable_and_unique_per_daemon() -> None:
    """A daemon without a fixed peer port is named by its socket: the same after a
    restart (the root then ends the old process's links at once), another for another
    daemon on the host."""
    from commd.daemon import default_peer_name

    secret = b"s" * 16
    listening = ServerConfig(Path("/run/a.sock"), peer_listen=("0.0.0.0", 7420), peer_secret=secret)
    assert default_peer_name(listening, "node1") == "node1:7420"
    dialing_only = ServerConfig(Path("/run/a.sock"), peer_secret=secret)
    assert default_peer_name(dialing_only, "node1") == "node1:/run/a.sock"
    any_port = ServerConfig(Path("/run/b.sock"), peer_listen=("127.0.0.1", 0), peer_secret=secret)
    assert default_peer_name(any_port, "node1") == "node1:/run/b.sock"


@pytest.mark.parametrize(("argv", "named"), [
    (("--metrics", "no-port-here"), "(from --metrics)"),
    (("--allow-group", "no-such-group-anywhere"), "--allow-group"),
    (("--max-buffers", "0"), "max_buffers"),
])
def test_an_error_names_the_flag_as_it_is_spelled(argv: tuple[str, ...], named: str) -> None:
    """(before: "from --metrics-listen", "--allow-groups": flags that do not exist)"""
    with pytest.raises(ConfigError) as caught:
        load_config(flags(*argv), {}, "")
    assert named in str(caught.value)
    assert "--metrics-listen" not in str(caught.value) and "--allow-groups" not in str(caught.value)


@pytest.mark.parametrize("argv, words", [
    (("--max-connections", str(1 << 64)), "max_connections: must be 1.."),
    (("--max-daemon-bytes", str(1 << 63)), "max_daemon_bytes: must be 1.."),
    (("--allow-uid", "-1"), "allow_uids: ids are 0.."),
    (("--allow-gid", str(1 << 32)), "allow_gids: ids are 0.."),
])
def test_values_a_status_report_could_not_carry_are_refused_at_start(argv: tuple[str, ...],
                                                                      words: str) -> None:
    """Accepted, they made every `commd status` fail for the daemon's whole life (the
    report carries the settings as msgpack integers)."""
    with pytest.raises(ConfigError, match=words):
        load_config(flags(*argv), {}, "")


@pytest.mark.parametrize(("env", "argv"), [
    ({"COMMD_PEER_NAME": "n" * 257}, ()),
    ({}, ("--peer-name", "")),
])
def test_a_peer_name_the_handshake_cannot_carry_is_refused_at_start(env: dict[str, str],
                                                                     argv: tuple[str, ...]) -> None:
    """Accepted, the daemon served, and every world across daemons failed when it dialed or
    answered: "the listener does not speak the peer protocol: daemon must be 1..256
    characters" (an empty one silently became the default name instead)."""
    message = error(Path("/nonexistent"), env=env, argv=argv)
    assert "peer_name: must be 1..256 characters" in message, message
    assert ("$COMMD_PEER_NAME" if env else "--peer-name") in message, message
    assert load_config(flags("--peer-name", "n" * 256), {}, "").peer_name == "n" * 256


def test_text_that_is_not_utf8_is_refused_but_a_path_may_be_any_bytes() -> None:
    with pytest.raises(ConfigError, match=r"peer_name .*not UTF-8"):
        load_config(flags(), {"COMMD_PEER_NAME": "\udcff"}, "")
    config = load_config(flags(), {"COMMD_SOCKET": os.fsdecode(b"/tmp/\xfe.sock")}, "")
    assert os.fsencode(config.socket_path) == b"/tmp/\xfe.sock"
    public = config.public()
    assert public["socket"] == "/tmp/\\xfe.sock"
    public["socket"].encode("utf-8")  # (what the report's encoder needs)


def test_a_secret_variable_is_taken_as_its_bytes() -> None:
    config = load_config(flags(), {"COMMD_PEER_SECRET": os.fsdecode(b"abc\xffdefghijklmnopqrst")}, "")
    assert config.peer_secret == b"abc\xffdefghijklmnopqrst"


@pytest.mark.parametrize("what", ["config", "secret"])
def test_a_fifo_or_an_endless_file_is_refused_not_read_for_ever(tmp_path: Path, what: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((str(fifo), "is not a regular file"), ("/dev/zero", "is not a regular file")):
        with pytest.raises(ConfigError, match=words):
            if what == "config":
                load_config(flags(), {}, path)
            else:
                load_config(flags("--peer-secret-file", path), {}, "")
    big = tmp_path / "big"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="larger than"):
        load_config(flags(), {}, str(big)) if what == "config" else \
            load_config(flags("--peer-secret-file", str(big)), {}, "")
