"""deploy/ and k8s/ work as docs/deployment.md says: the local config serves as a normal user, the
node config says it is not for local use, the image's build context leaves the environments out,
the page's deploy commands name files that exist and render where the tool is installed, and a
server refuses the public credentials an older k8s example shipped."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness.ports import free_port
from harness.serve import ServerProcess

from kvstore import KVStoreClient, Namespace
from kvstore.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "deploy" / "kvstore.local.toml"
NS = Namespace(model="deploy-test", num_layers=1, num_kv_heads=1, head_size=8)


def test_local_config_serves_as_a_normal_user(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    listen = f"127.0.0.1:{free_port()}"
    # The port and sizes are overridden for the test; the socket, mode and loopback are the file's.
    server = ServerProcess(
        tmp_path / "serve",
        ["--config", str(LOCAL), "--listen", listen],
        env={"KVSTORE_NVME_PATH": str(tmp_path / "nvme"), "KVSTORE_DRAM_CAPACITY": "16MiB"},
        tmpdir=tmpdir,
    ).start()
    try:
        assert server.target == listen
        (directory,) = tmpdir.iterdir()  # socket "auto": a private directory in $TMPDIR
        socket = directory / "shm.sock"
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600
        with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
            assert client.put([b"k" * 16], [b"v" * 128]).stored == 1
            assert client.get([b"k" * 16]) == [b"v" * 128]
            assert client.data_plane == "shm"
    finally:
        assert server.stop() == 0, server.output()
    assert (tmp_path / "nvme" / "integrity.key").exists()


def test_local_config_needs_no_root_paths() -> None:
    config = load_config(str(LOCAL), env={"HOME": "/home/someone"})
    assert config.server.listen.startswith("127.0.0.1:")
    assert config.shm.socket == "auto"
    assert config.ucx.listen == ""
    assert config.nvme.path == "/home/someone/.local/share/kvstore/nvme"


def test_node_config_says_it_is_not_for_local_use() -> None:
    text = (ROOT / "deploy" / "kvstore.toml").read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert "does NOT run as a normal user" in header
    assert "deploy/kvstore.local.toml" in header
    # Still a valid configuration for the image.
    assert load_config(str(ROOT / "deploy" / "kvstore.toml"), env={}).nvme.path.startswith(
        "/var/lib/kvstore"
    )


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker's ignore rules (as used here: no ``!`` exceptions) leave ``path`` out."""
    for pattern in patterns:
        pattern = pattern.strip("/")
        if pattern.startswith("**/"):
            rest = pattern[3:]
            if any(fnmatch.fnmatch(part, rest) for part in path.split("/")):
                return True
        elif fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
            return True
    return False


def test_dockerignore_leaves_out_every_large_directory() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns)
    for path in [
        ".git",
        ".venv",
        ".venv-vllm",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".hypothesis",
        "kvstore/__pycache__",
        "tiered_kvstore.egg-info",
        "build",
        "dist",
        "data",
        "tests",
        "benchmarks",
    ]:
        assert _ignored(path, patterns), f"{path} would be sent to the docker daemon"
    # Every directory .gitignore names (build outputs, environments) is left out too.
    for line in (ROOT / ".gitignore").read_text().splitlines():
        entry = line.strip().strip("/")
        if entry and not entry.startswith("#") and "results" not in entry:
            assert _ignored(entry.replace("*", "x"), patterns), f"{entry} not in .dockerignore"
    # What the Dockerfiles copy must stay in the context.
    for name in ("Dockerfile", "vllm.Dockerfile"):
        dockerfile = (ROOT / "deploy" / name).read_text()
        copied = [
            src
            for line in dockerfile.splitlines()
            if line.startswith("COPY ")
            for src in line.split()[1:-1]
        ]
        assert copied
        for src in copied:
            assert (ROOT / src).exists(), src
            assert not _ignored(src, patterns), f"{src} is copied by {name} but ignored"


def test_the_vllm_example_image_is_built_by_a_dockerfile_here() -> None:
    manifest = (ROOT / "k8s" / "components" / "vllm-example" / "vllm.yaml").read_text()
    dockerfile = (ROOT / "deploy" / "vllm.Dockerfile").read_text()
    image = "vllm-kvstore:0.1.0"
    assert f"image: {image}" in manifest
    build = f"docker build -f deploy/vllm.Dockerfile -t {image} ."
    assert build in dockerfile and build in (ROOT / "docs" / "deployment.md").read_text()
    # The same environment scripts/setup-vllm.sh makes: the pinned CPU torch, the vllm extra,
    # and the CUDA builds that break `import vllm` removed.
    setup = (ROOT / "scripts" / "setup-vllm.sh").read_text()
    assert "torch==2.13.0" in dockerfile and "torch==2.13.0" in setup
    assert '".[vllm]"' in dockerfile
    assert "uninstall -y torchvision torchaudio torchcodec" in dockerfile
    assert 'python -c "import vllm, kvstore.integrations.vllm"' in dockerfile
    assert "\nUSER " in dockerfile


def test_deploy_files_name_manifests_where_they_are() -> None:
    for path in ("deploy/Dockerfile", "deploy/kvstore.toml"):
        for name in re.findall(r"k8s/[\w./-]+\.yaml", (ROOT / path).read_text()):
            assert (ROOT / name).exists(), f"{path} names {name}, which does not exist"


def test_the_deploy_pages_commands_name_files_that_exist() -> None:
    readme = (ROOT / "docs" / "deployment.md").read_text()
    for command in (
        "docker build -f deploy/Dockerfile",
        "docker compose -f deploy/compose.yaml up",
        "kubectl apply -k k8s/base",
        "kvstore serve --config deploy/kvstore.local.toml",
    ):
        assert command in readme, command
    for path in ("deploy/Dockerfile", "deploy/compose.yaml", "k8s/base/kustomization.yaml"):
        assert (ROOT / path).exists()


PUBLIC_TOKEN = "example-token-REPLACE-ME"  # what k8s/base/kustomization.yaml shipped


@pytest.mark.parametrize(
    "case", ["public-token", "public-integrity-secret", "placeholder-secret-file"]
)
def test_a_server_refuses_public_and_placeholder_credentials(tmp_path: Path, case: str) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"engine {hashlib.sha256(PUBLIC_TOKEN.encode()).hexdigest()}\n")
    secret_file = tmp_path / "secret"
    secret_file.write_text("CHANGE_ME\n")
    secret_file.chmod(0o600)
    env = {**os.environ, "KVSTORE_NVME_PATH": str(tmp_path / "nvme")}
    flags = ["--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", ""]
    if case == "public-token":
        flags += ["--tokens-file", str(tokens)]
        setting = f"auth.tokens_file {tokens} line 1 (engine)"
    elif case == "public-integrity-secret":
        env["KVSTORE_INTEGRITY_SECRETS"] = "example-integrity-secret-REPLACE-ME"
        setting = "integrity.secrets (KVSTORE_INTEGRITY_SECRETS), secret 1"
    else:
        env["KVSTORE_INTEGRITY_SECRET_FILE"] = str(secret_file)
        setting = f"integrity.secret_file: {secret_file}, secret 1"
    # A server that accepts them would serve: the timeout is what such a failure looks like.
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode != 0
    assert setting in done.stderr and "Replace it" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
