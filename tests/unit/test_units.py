"""The deploy/ files: the systemd units say what the daemon does, and agree with its defaults."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from commd.config import DEFAULT_SOCKET, KEY_OF_FIELD, ServerConfig
from commd.settings import KEYS, file_layer

pytestmark = pytest.mark.timeout(10)
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys may repeat, as DeviceAllow= does)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in (DEPLOY / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{name}: {line!r} is not KEY=VALUE"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key)
    assert values is not None and len(values) == 1, f"{key}: {values}"
    return values[0]


def test_service_is_notify_with_watchdog_and_restart() -> None:
    service = unit("commd.service")["Service"]
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    assert re.fullmatch(r"\d+s?", one(service, "WatchdogSec"))
    assert one(service, "Restart") == "on-failure"
    assert one(service, "RestartPreventExitStatus") == "2"  # what `commd serve` exits with on bad config
    assert one(service, "ExecStart") == "/opt/commd/venv/bin/commd serve --config /etc/commd/commd.toml"


def test_service_runs_as_commd_in_its_runtime_directory() -> None:
    service = unit("commd.service")["Service"]
    assert (one(service, "User"), one(service, "Group")) == ("commd", "commd")
    assert one(service, "RuntimeDirectory") == "commd"
    assert one(service, "RuntimeDirectoryMode") == "0750"
    # the socket unit's file lives there: it must survive the service's restarts
    assert one(service, "RuntimeDirectoryPreserve") == "yes"
    assert Path(DEFAULT_SOCKET).parent == Path("/run") / one(service, "RuntimeDirectory")


def test_service_hardening_keeps_cuda_working() -> None:
    service = unit("commd.service")["Service"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes"), ("DevicePolicy", "closed"), ("CapabilityBoundingSet", ""),
                       ("AmbientCapabilities", ""), ("LockPersonality", "yes"),
                       ("ProtectKernelTunables", "yes")):
        assert one(service, key) == value, key
    families = one(service, "RestrictAddressFamilies").split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    allowed = " ".join(service["DeviceAllow"])
    for device in ("/dev/nvidiactl", "char-nvidia-frontend", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                   "char-nvidia-caps"):
        assert device in allowed, device
    # the CUDA driver JIT-compiles into executable memory; PrivateDevices hides the GPUs
    assert "MemoryDenyWriteExecute" not in service
    assert "PrivateDevices" not in service


def test_socket_unit_matches_the_daemon_default() -> None:
    sock = unit("commd.socket")["Socket"]
    assert one(sock, "ListenSequentialPacket") == DEFAULT_SOCKET
    assert one(sock, "SocketMode") == "0660"
    assert (one(sock, "SocketUser"), one(sock, "SocketGroup")) == ("commd", "commd")
    assert one(sock, "DirectoryMode") == "0750"
    assert unit("commd.socket")["Install"]["WantedBy"] == ["sockets.target"]
    # the socket outlives a restart of the service (PartOf would restart it too, dropping
    # the connections waiting in its backlog)
    assert "PartOf" not in unit("commd.socket")["Unit"]


def test_user_group_and_runtime_directory_files() -> None:
    sysusers = (DEPLOY / "commd.sysusers").read_text()
    assert re.search(r"^g commd -$", sysusers, re.M) and re.search(r"^u commd -:commd ", sysusers, re.M)
    tmpfiles = (DEPLOY / "commd.tmpfiles").read_text()
    assert re.search(r"^d /run/commd 0750 commd commd -$", tmpfiles, re.M)


def test_example_config_shows_every_key_with_its_default() -> None:
    text = (DEPLOY / "commd.toml").read_text()
    shown = dict(re.findall(r"^# ([a-z_]+) = (.+)$", text, re.M))
    assert set(shown) == set(KEYS), set(KEYS) ^ set(shown)
    defaults = ServerConfig(socket_path=Path(DEFAULT_SOCKET))
    field_of = {key: field for field, key in KEY_OF_FIELD.items()}
    for key, literal in shown.items():
        value = tomllib.loads(f"v = {literal}")["v"]
        field = field_of.get(key, key)
        if field not in ServerConfig.__dataclass_fields__:
            assert value == [] or key == "peer_secret_file", key  # allow_groups: none by default
            continue
        default = getattr(defaults, field)
        if default is None:
            continue  # an example value: the default is "unset"
        if key in ("allow_uids", "allow_gids"):
            assert value == [], key  # own uid and root are always added, never configured
        elif key == "socket":
            assert value == str(default)
        else:
            assert value == default, key
    # and the active lines load
    assert file_layer(str(DEPLOY / "commd.toml"))["allow_groups"].raw == ["commd"]
