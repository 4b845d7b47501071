"""Who may call a real ``kvstore serve``: bearer tokens, TLS, client certificates, exposure.

Nothing is mocked: servers are ``kvstore serve`` subprocesses, certificates are made by the
``openssl`` command (tests/harness/certs.py), tokens go in a real tokens file (hashed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.certs import Pki, make_pki
from harness.serve import clean_env
from harness.server_factory import NAMESPACE

from kvstore import AsyncKVStoreClient, KVStoreClient
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import AuthenticationError, KVStoreError

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

TOKEN = "s3cret-token-of-alice"
KEYS = [bytes([i]) * 16 for i in range(3)]
VALUES = [bytes([i]) * 4096 for i in range(3)]


def _tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    path.write_text(f"# name sha256hex\nalice {digest}\nbob {'0' * 64}  # another\n")
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _code(call: grpc.UnaryUnaryMultiCallable, request: object, **kwargs: object) -> object:
    with pytest.raises(grpc.RpcError) as failure:
        call(request, timeout=5, **kwargs)
    return failure.value.code(), failure.value.details()


def test_tokens_refuse_missing_and_wrong_and_serve_the_right_one(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory("--tokens-file", str(_tokens_file(tmp_path)))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        code, details = _code(stub.Stats, pb.StatsRequest())  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "KVSTORE_TOKEN" in details
        code, _ = _code(stub.Stats, pb.StatsRequest(), metadata=[("authorization", "Bearer nope")])
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, details = _code(stub.Stats, pb.StatsRequest(), metadata=[("authorization", TOKEN)])
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
        # A streaming method and the data-plane discovery are covered alike.
        with pytest.raises(grpc.RpcError) as failure:
            list(stub.Get(pb.GetRequest(keys=KEYS), timeout=5))
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(stub.DataPlane, pb.DataPlaneRequest())
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # Probes need no token.
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    with server.client() as anonymous, pytest.raises(AuthenticationError, match="KVSTORE_TOKEN"):
        anonymous.put(KEYS, VALUES)
    with server.client(token="wrong") as wrong, pytest.raises(AuthenticationError, match="not acc"):
        wrong.lookup(KEYS)
    with server.client(token=TOKEN) as alice:
        assert alice.put(KEYS, VALUES).stored == len(KEYS)
        assert alice.get(KEYS) == VALUES
        assert alice.stats()["blocks"] == len(KEYS)
    # Over gRPC only too (the shm plane above may have carried the data).
    with server.client(token=TOKEN, data_plane="grpc") as alice:
        assert alice.get(KEYS) == VALUES
    assert server.running


def test_token_from_the_environment_and_the_async_client(
    server_factory: ServerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory("--tokens-file", str(_tokens_file(tmp_path)))
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)
    with server.client(data_plane="grpc") as client:
        client.put(KEYS, VALUES)

    async def read() -> list[bytes | None]:
        async with AsyncKVStoreClient(
            server.target, namespace=NAMESPACE, data_plane="grpc"
        ) as client:
            return await client.get(KEYS)

    import asyncio

    assert asyncio.run(read()) == VALUES
    stats = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "KVSTORE_TOKEN": ""},
    )
    assert stats.returncode == 2 and "KVSTORE_TOKEN" in stats.stderr
    stats = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert stats.returncode == 0, stats.stderr


def test_tls_client_with_the_ca_works_and_a_plain_client_fails(
    server_factory: ServerFactory, pki: Pki
) -> None:
    server = server_factory("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    with server.client(tls_ca=str(pki.ca), data_plane="grpc", timeout=3) as client:
        client.put(KEYS, VALUES)
        assert client.get(KEYS) == VALUES
    with server.client(tls_ca=pki.ca.read_bytes(), data_plane="grpc", timeout=3) as client:
        assert client.lookup(KEYS) == len(KEYS)
    with server.client(data_plane="grpc", timeout=2) as plain, pytest.raises(KVStoreError):
        plain.lookup(KEYS)
    # A client trusting another CA refuses the server's certificate.
    wrong = server.client(tls_ca=str(pki.rogue_ca), data_plane="grpc", timeout=2)
    with wrong, pytest.raises(KVStoreError):
        wrong.lookup(KEYS)
    assert server.running


def test_mtls_refuses_a_client_without_a_certificate_or_with_a_foreign_one(
    server_factory: ServerFactory, pki: Pki
) -> None:
    server = server_factory(
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), "--log-level", "DEBUG",
    )  # fmt: skip
    anonymous = server.client(tls_ca=str(pki.ca), data_plane="grpc", timeout=2)
    with anonymous, pytest.raises(KVStoreError):
        anonymous.lookup(KEYS)
    foreign = {"tls_cert": str(pki.rogue_cert), "tls_key": str(pki.rogue_key)}
    mallory = server.client(tls_ca=str(pki.ca), data_plane="grpc", timeout=2, **foreign)
    with mallory, pytest.raises(KVStoreError):
        mallory.lookup(KEYS)
    own = {"tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    with server.client(tls_ca=str(pki.ca), data_plane="grpc", timeout=3, **own) as alice:
        alice.put(KEYS, VALUES)
        assert alice.get(KEYS) == VALUES
    assert "called by alice" in server.stderr()
    assert server.running


def _serve(*flags: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "serve",
            "--nvme-path",
            "",
            "--metrics-listen",
            "127.0.0.1:0",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(),  # none of a user's KVSTORE_* settings
    )


@pytest.mark.parametrize(
    "flags",
    [
        ("--listen", "0.0.0.0:0"),
        ("--listen", "[::]:0"),
        ("--listen", "127.0.0.1:0", "--ucx-listen", "127.0.0.1:0"),
    ],
    ids=["any-v4", "any-v6", "ucx"],
)
def test_listening_beyond_loopback_without_authentication_refuses_to_start(
    flags: tuple[str, ...],
) -> None:
    result = _serve(*flags, "--dram-capacity", "16MiB")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    setting = "ucx.listen" if "--ucx-listen" in flags else "server.listen"
    assert setting in lines[0] and "allow_unauthenticated" in lines[0]


def test_beyond_loopback_starts_with_the_allow_flag_or_with_tokens(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    allowed = server_factory("--listen", "0.0.0.0:0", "--allow-unauthenticated")
    port = allowed.target.rpartition(":")[2]
    with KVStoreClient(f"127.0.0.1:{port}", namespace=NAMESPACE, data_plane="grpc") as client:
        assert client.lookup(KEYS) == 0
    tokens = server_factory("--listen", "0.0.0.0:0", "--tokens-file", str(_tokens_file(tmp_path)))
    port = tokens.target.rpartition(":")[2]
    with KVStoreClient(
        f"127.0.0.1:{port}", namespace=NAMESPACE, token=TOKEN, data_plane="grpc"
    ) as client:
        assert client.lookup(KEYS) == 0


def test_a_bad_tokens_file_refuses_to_start_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"alice {TOKEN}\n")  # the token in clear, not its hash
    result = _serve("--listen", "127.0.0.1:0", "--tokens-file", str(path))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "line 1" in result.stderr and "SHA256HEX" in result.stderr


def test_shared_memory_keeps_working_for_a_colocated_client_with_a_token(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory("--tokens-file", str(_tokens_file(tmp_path)))
    with server.client(token=TOKEN, data_plane="shm") as client:
        client.put(KEYS, VALUES)
        assert client.get(KEYS) == VALUES
        assert client.data_plane == "shm"


def test_ucx_control_calls_carry_the_token_and_need_it(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
    from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc

    tokens = str(_tokens_file(tmp_path))
    # With tokens, a UCX listener needs no --allow-unauthenticated.
    server = server_factory("--tokens-file", tokens, "--ucx-listen", "127.0.0.1:0")
    with grpc.insecure_channel(server.target) as channel:
        stub = ucx_pb_grpc.UcxTransferStub(channel)
        code, details = _code(stub.UcxGet, ucx_pb.UcxGetRequest())  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAUTHENTICATED and "KVSTORE_TOKEN" in details
        # The bind that gives endpoints their control-message key is checked the same way.
        bind = ucx_pb.UcxBindRequest(client_ids=[b"x" * 16], versions=[1])
        code, details = _code(stub.UcxBind, bind)  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAUTHENTICATED and "KVSTORE_TOKEN" in details
    with server.client(token=TOKEN, data_plane="ucx") as client:
        client.put(KEYS, VALUES)
        assert client.get(KEYS) == VALUES
        assert client.data_plane == "ucx"


def test_demo_over_tls_with_a_token(
    server_factory: ServerFactory, tmp_path: Path, pki: Pki
) -> None:
    server = server_factory(
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tokens-file", str(_tokens_file(tmp_path)),
    )  # fmt: skip
    command = [sys.executable, "-m", "kvstore.cli", "demo", "--target", server.target]
    env = {**os.environ, "KVSTORE_DATA_PLANE": "grpc", "KVSTORE_TOKEN": ""}
    run = subprocess.run(
        [*command, "--wait", "10", "--tls-ca", str(pki.ca), "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 0 and "demo OK" in run.stdout, run.stderr
    env = {**env, "KVSTORE_TLS_CA": str(pki.ca)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2 and "KVSTORE_TOKEN" in run.stderr, run.stderr
