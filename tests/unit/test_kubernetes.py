"""deploy/kubernetes: the manifests parse and wire the socket, GPUs, peer port and secret."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from commd.config import DEFAULT_SOCKET
from commd.settings import file_layer

yaml = pytest.importorskip("yaml")
pytestmark = pytest.mark.timeout(10)
K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert len(docs) == 1
    doc: dict[str, Any] = docs[0]
    return doc


def test_every_manifest_parses() -> None:
    kinds = sorted(load(p.name)["kind"] for p in K8S.glob("*.yaml"))
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "Pod"]


def test_daemonset_wires_socket_gpus_peer_port_secret_and_readiness() -> None:
    ds = load("daemonset.yaml")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["run"]["hostPath"]["path"] == mounts["run"] == str(Path(DEFAULT_SOCKET).parent)
    assert pod["hostNetwork"] is True and {"name": "peer", "containerPort": 7420, "protocol": "TCP"} in \
        container["ports"]
    assert pod["runtimeClassName"] == "nvidia" and pod["enableServiceLinks"] is False
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert volumes["peer-secret"]["secret"]["secretName"] == "commd-peer-secret"
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["commd", "status"] and DEFAULT_SOCKET in probe
    assert container["command"] == ["commd", "serve", "--config", "/etc/commd/commd.toml"]


def test_config_map_is_a_valid_config(tmp_path: Path) -> None:
    text = load("commd-config.yaml")["data"]["commd.toml"]
    (tmp_path / "commd.toml").write_text(text)
    values = {name: v.raw for name, v in file_layer(str(tmp_path / "commd.toml")).items()}
    assert values["socket"] == DEFAULT_SOCKET
    assert values["peer_secret_file"].startswith("/etc/commd/secret/")
    worker = load("worker-pod.yaml")["spec"]
    assert values["allow_gids"] == worker["securityContext"]["supplementalGroups"]


def test_worker_pod_mounts_the_socket_directory() -> None:
    pod = load("worker-pod.yaml")["spec"]
    (container,) = pod["containers"]
    (mount,) = container["volumeMounts"]
    (volume,) = pod["volumes"]
    assert mount["mountPath"] == volume["hostPath"]["path"] == str(Path(DEFAULT_SOCKET).parent)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
