"""Every k8s overlay renders with ``kubectl kustomize`` (offline) and every rendered object is valid
against the Kubernetes schema (``kubernetes-validate --strict``, its bundled schemas), and the
manifests mean what docs/deployment.md says: only engines reach the store, the engine mounts the
store's socket directory, the store listens beyond loopback only with tokens from the Secret, and
those credentials are made at deploy time (``k8s/generate-secrets.sh``), never shipped.

The overlays are rendered from a copy of ``k8s/`` in a temporary directory, with credentials that
the script generated there: the test never writes into the working tree."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstore.config import load_config
from kvstore.server.auth import check_exposure, load_tokens
from kvstore.server.integrity import load_keyring
from kvstore.server.placeholders import PUBLIC_VALUES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
GENERATE = "generate-secrets.sh"
SECRETS = ("tokens", "engine-token", "integrity-secrets")
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
#: A Kubernetes version kubernetes-validate bundles strict schemas for (that of Debian's kubectl).
K8S_VERSION = "1.32.0"
ENGINE_LABEL = ("kvstore.io/client", "true")
#: Custom resources: kubernetes-validate has schemas for the built-in kinds only, so these are
#: checked by test_service_monitor_scrapes_the_metrics_port_with_the_token instead (their
#: references), and validate() is asserted to raise SchemaNotFoundError for them, not skipped.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not installed: apt-get install kubectl (from pkgs.k8s.io; Debian 12 has "
            "none; scripts/test.sh installs it) to render the k8s overlays offline"
        )
    return kubectl


def copy_k8s(destination: Path) -> Path:
    """A copy of ``k8s/`` as git has it: without credentials a developer generated here."""

    def generated(directory: str, names: list[str]) -> set[str]:
        return (
            {n for n in names if n != ".gitignore"} if Path(directory).name == "secrets" else set()
        )

    shutil.copytree(K8S, destination, ignore=generated)
    return destination


def generate(tree: Path, *args: str) -> None:
    done = subprocess.run(
        ["bash", str(tree / GENERATE), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


_TREE: list[Path] = []  # the module's copy, with generated credentials


@pytest.fixture(scope="module", autouse=True)
def _k8s_tree() -> Iterator[None]:
    tree = copy_k8s(Path(tempfile.mkdtemp(prefix="kvt-k8s-")) / "k8s")
    generate(tree)
    _TREE.append(tree)
    yield
    _TREE.clear()
    render.cache_clear()
    shutil.rmtree(tree.parent, ignore_errors=True)


def kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@cache
def render(path: str) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize k8s/path`` renders (from the module's copy)."""
    result = kustomize(_TREE[0] / path)
    assert result.returncode == 0, f"kubectl kustomize k8s/{path}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def one(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def test_there_are_the_overlays_the_deploy_page_names() -> None:
    assert OVERLAYS == ["full", "monitoring", "redis", "redis-cluster", "vllm-example"]
    readme = (ROOT / "docs" / "deployment.md").read_text()
    for name in OVERLAYS:
        assert f"k8s/overlays/{name}" in readme, name


@pytest.mark.parametrize("path", ["base", *(f"overlays/{name}" for name in OVERLAYS)])
def test_renders_and_every_object_validates_strictly(path: str) -> None:
    objects = render(path)
    assert objects
    for obj in objects:
        what = f"k8s/{path}: {obj['kind']}/{obj['metadata']['name']}"
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{what} is not valid Kubernetes {K8S_VERSION}: {str(exc).splitlines()[0]}")


def test_strict_validation_rejects_a_misspelt_field() -> None:
    # The validation above would pass anything if the schemas were lax: a typo must fail.
    daemonset = dict(one(render("base"), "DaemonSet", "kvstore"))
    daemonset["spec"] = {**daemonset["spec"], "replicas": 3}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, K8S_VERSION, strict=True)


def test_only_custom_resources_are_in_the_monitoring_component() -> None:
    for path in ("base", "overlays/redis", "overlays/redis-cluster", "overlays/vllm-example"):
        kinds = {(o["apiVersion"], o["kind"]) for o in render(path)}
        assert not kinds & CUSTOM_KINDS, path


def test_every_manifest_file_is_listed_in_its_kustomization() -> None:
    for directory in [K8S / "base", *(K8S / "components").iterdir()]:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        listed = set(kustomization.get("resources", [])) | {
            p["path"] for p in kustomization.get("patches", [])
        }
        files = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
        assert files == listed, directory


def _container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def _port(obj: dict[str, Any], container: str, name: str) -> int:
    (port,) = [p for p in _container(obj, container)["ports"] if p["name"] == name]
    return int(port["containerPort"])


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("path", ["base", "overlays/full"])
def test_network_policy_admits_only_engines_on_the_data_ports(path: str) -> None:
    objects = render(path)
    daemonset = one(objects, "DaemonSet", "kvstore")
    policy = one(objects, "NetworkPolicy", "kvstore")["spec"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["podSelector"]["matchLabels"], pod_labels)
    assert policy["policyTypes"] == ["Ingress"]
    data_ports = {_port(daemonset, "kvstore", "grpc"), _port(daemonset, "kvstore", "ucx")}
    metrics_port = _port(daemonset, "kvstore", "metrics")
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), "a rule without 'from' admits every pod"
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == data_ports | {metrics_port}
    for port in data_ports:
        (peer,) = admitted[port]
        assert peer == {"podSelector": {"matchLabels": dict([ENGINE_LABEL])}}, port
    (prometheus,) = admitted[metrics_port]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "namespaceSelector" in prometheus  # not "any pod named prometheus in any namespace"
    env = {e["name"]: e.get("value") for e in _container(daemonset, "kvstore")["env"]}
    assert env["KVSTORE_SERVER_METRICS_LISTEN"] == f"0.0.0.0:{metrics_port}"
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)


@pytest.mark.parametrize("path", ["overlays/vllm-example", "overlays/full"])
def test_engine_is_admitted_and_mounts_the_store_socket_directory(path: str) -> None:
    objects = render(path)
    daemonset = one(objects, "DaemonSet", "kvstore")
    vllm = one(objects, "Deployment", "vllm")
    pod = vllm["spec"]["template"]
    assert pod["metadata"]["labels"][ENGINE_LABEL[0]] == ENGINE_LABEL[1]
    config = tomllib.loads(one(objects, "ConfigMap", "kvstore-config")["data"]["kvstore.toml"])
    socket_dir = str(Path(config["shm"]["socket"]).parent)

    def host_dir(obj: dict[str, Any], container: str) -> str:
        volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        for mount in _container(obj, container)["volumeMounts"]:
            if mount["mountPath"] == socket_dir:
                return str(volumes[mount["name"]]["hostPath"]["path"])
        raise AssertionError(f"{obj['metadata']['name']} does not mount {socket_dir}")

    assert host_dir(vllm, "vllm") == host_dir(daemonset, "kvstore")
    store_group = _container(daemonset, "kvstore")["securityContext"]["runAsGroup"]
    assert store_group in pod["spec"]["securityContext"]["supplementalGroups"]
    assert config["shm"]["socket_mode"] & 0o060 == 0o060  # the group may connect
    engine = _container(vllm, "vllm")
    transfer = engine["args"][engine["args"].index("--kv-transfer-config") + 1]
    grpc_port = _port(daemonset, "kvstore", "grpc")
    assert f'"target": "$(NODE_IP):{grpc_port}"' in transfer
    env = {e["name"]: e for e in engine["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["KVSTORE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "kvstore-tokens"
    assert int(engine["resources"]["requests"]["nvidia.com/gpu"]) >= 1


@pytest.mark.parametrize("path", ["base", *(f"overlays/{name}" for name in OVERLAYS)])
def test_store_listens_beyond_loopback_only_with_tokens(path: str, tmp_path: Path) -> None:
    objects = render(path)
    text = one(objects, "ConfigMap", "kvstore-config")["data"]["kvstore.toml"]
    auth = tomllib.loads(text)["auth"]
    assert "allow_unauthenticated" not in auth
    daemonset = one(objects, "DaemonSet", "kvstore")
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [
        m
        for m in _container(daemonset, "kvstore")["volumeMounts"]
        if auth["tokens_file"].startswith(m["mountPath"] + "/")
    ]
    secret_name = volumes[mount["name"]]["secret"]["secretName"]
    secret = one(objects, "Secret", secret_name)
    # The generated token matches its hashed line, and is nobody's example.
    engine_token = secret["data"]["engine-token"]
    token = base64.b64decode(engine_token).decode()
    tokens = base64.b64decode(secret["data"]["tokens"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", token) and token not in PUBLIC_VALUES
    assert hashlib.sha256(token.encode()).hexdigest() in tokens.split()
    integrity = base64.b64decode(secret["data"]["integrity-secrets"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", integrity) and integrity != token
    # The configuration loads as the container sees it (tokens file in place, env applied).
    (tmp_path / "tokens").write_text(tokens)
    config_file = tmp_path / "kvstore.toml"
    config_file.write_text(
        text.replace(auth["tokens_file"], str(tmp_path / "tokens")).replace(
            "/var/lib/kvstore/nvme", str(tmp_path / "nvme")
        )
    )
    env = {e["name"]: e["value"] for e in _container(daemonset, "kvstore")["env"] if "value" in e}
    env.pop("KVSTORE_SERVER_METRICS_LISTEN")  # a setting of the metrics change (issue 14)
    env["KVSTORE_INTEGRITY_SECRETS"] = integrity  # from the Secret, as the DaemonSet's env says
    config = load_config(str(config_file), env=env)
    assert not config.server.listen.startswith("127.")
    assert config.auth.tokens_file and not config.auth.allow_unauthenticated
    check_exposure(config)  # would raise beyond loopback without tokens
    assert list(load_tokens(config.auth.tokens_file).values()) == ["engine"]
    load_keyring(config)  # would raise for a public or placeholder secret


def test_the_shipped_tree_renders_no_credentials_until_they_are_generated(tmp_path: Path) -> None:
    """Nothing public works: without the script's files the base does not render at all."""
    tree = copy_k8s(tmp_path / "k8s")
    for path in ("base", "overlays/full"):
        refused = kustomize(tree / path)
        assert refused.returncode != 0
        assert "secrets/tokens" in refused.stderr
    generate(tree)
    assert kustomize(tree / "base").returncode == 0


def test_generated_credentials_are_private_random_and_kept(tmp_path: Path) -> None:
    tree = copy_k8s(tmp_path / "k8s")
    generate(tree)
    secrets_dir = tree / "base" / "secrets"
    first = {name: (secrets_dir / name).read_text() for name in SECRETS}
    for name in SECRETS:
        assert stat.S_IMODE(os.stat(secrets_dir / name).st_mode) == 0o600, name
    # No newline: the token goes into an environment variable and a header as it is.
    assert re.fullmatch(r"[0-9a-f]{64}", first["engine-token"])
    digest = hashlib.sha256(first["engine-token"].encode()).hexdigest()
    assert first["tokens"] == f"engine {digest}\n"
    generate(tree)  # run again: the deployed credentials stay
    assert {name: (secrets_dir / name).read_text() for name in SECRETS} == first
    generate(tree, "--force")  # rotation: all new
    again = {name: (secrets_dir / name).read_text() for name in SECRETS}
    assert all(again[name] != first[name] for name in SECRETS)
    # git ignores them: only the .gitignore is in the repository.
    ignored = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", "k8s/base/secrets/engine-token"],
        timeout=30,
    )
    assert ignored.returncode == 0


def test_service_monitor_scrapes_the_metrics_port_with_the_token() -> None:
    objects = render("overlays/monitoring")
    monitor = one(objects, "ServiceMonitor", "kvstore")["spec"]
    service = one(objects, "Service", "kvstore")
    assert _matches(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["endpoints"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports[endpoint["port"]]["port"] == 9464
    credentials = endpoint["authorization"]["credentials"]
    assert credentials["key"] in one(objects, "Secret", credentials["name"])["data"]
    assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize(
    ("path", "url", "replicas"),
    [
        ("overlays/redis", "redis://kvstore-redis:6379/0", 1),
        ("overlays/redis-cluster", "redis+cluster://kvstore-redis-cluster:6379", 6),
        ("overlays/full", "redis+cluster://kvstore-redis-cluster:6379", 6),
    ],
)
def test_stores_point_at_the_redis_of_their_overlay(path: str, url: str, replicas: int) -> None:
    objects = render(path)
    env = {e["name"]: e for e in _container(one(objects, "DaemonSet", "kvstore"), "kvstore")["env"]}
    assert env["KVSTORE_REDIS_URL"]["value"] == url
    assert env["KVSTORE_INTEGRITY_SECRETS"]["valueFrom"]["secretKeyRef"]["name"] == "kvstore-tokens"
    service = url.split("//")[1].split(":")[0]
    one(objects, "Service", service)
    kind = "Deployment" if replicas == 1 else "StatefulSet"
    assert one(objects, kind, service)["spec"]["replicas"] == replicas
    policy = one(objects, "NetworkPolicy", service)["spec"]
    peers = [peer for rule in policy["ingress"] for peer in rule["from"]]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvstore"}}} in peers
    if replicas > 1:
        job = one(objects, "Job", f"{service}-init")
        script = _container(job, "cluster-init")["command"][-1]
        assert "--cluster-replicas 1" in script and "cluster_state:ok" in script
        assert script.count("0 1 2 3 4 5") == 1
