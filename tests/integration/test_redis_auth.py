"""The shared tier behind a password and TLS: a real password-protected (ACL user) redis-server,
and one serving TLS only, reached by real ``kvstore serve`` processes.

A wrong password leaves the tier down, the server serving from its local tiers and saying why in
its log, without the password.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.certs import Pki, make_pki
from harness.polling import poll
from harness.redis_server import RedisServer

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

PASSWORD = "redis-pass-of-kvstore"
# Nodes that share a Redis share the secret its blocks are signed with.
CLUSTER_SECRET = {"KVSTORE_INTEGRITY_SECRETS": "redis-auth test secret"}
KEYS = [bytes([i]) * 16 for i in range(4)]
VALUES = [bytes([i]) * 8192 for i in range(4)]


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis", username="kvstore", password=PASSWORD) as server:
        yield server


def _stored_in_redis(server: RedisServer) -> int:
    client = server.client()
    try:
        # Blocks only: their names are hex (the nodes' keyring record is "kvstore:v1:keyring").
        return len([n for n in client.scan_iter(match="kvstore:*") if not n.endswith(b"keyring")])
    finally:
        client.close()


def test_an_acl_user_with_its_password_reaches_the_shared_tier(
    server_factory: ServerFactory, acl_redis: RedisServer
) -> None:
    assert acl_redis.url.startswith("redis://kvstore:")
    node = server_factory("--redis-url", acl_redis.url, env=CLUSTER_SECRET)
    with node.client(data_plane="grpc") as client:
        client.put(KEYS, VALUES)
        poll(lambda: _stored_in_redis(acl_redis) >= len(KEYS), 5, "write-through to redis")
        assert client.stats()["tiers"]["redis"]["up"] == 1
    # Another node, same credentials, finds the blocks in the shared tier.
    other = server_factory("--redis-url", acl_redis.url, env=CLUSTER_SECRET)
    with other.client(data_plane="grpc") as client:
        assert client.lookup_tiers(KEYS).tiers == ["redis"] * len(KEYS)
        assert client.get(KEYS) == VALUES


def test_a_wrong_password_leaves_the_tier_down_and_serving_goes_on(
    server_factory: ServerFactory, acl_redis: RedisServer
) -> None:
    wrong = acl_redis.url.replace(PASSWORD, "not-the-password")
    node = server_factory("--redis-url", wrong)
    with node.client(data_plane="grpc") as client:
        client.put(KEYS, VALUES)  # stored locally; the write-through fails
        poll(lambda: client.stats()["tiers"]["redis"]["up"] == 0, 5, "the tier marked down")
        assert client.get(KEYS) == VALUES
    assert _stored_in_redis(acl_redis) == 0
    log = node.stderr()
    assert "redis tier down" in log and "AuthenticationError" in log, log[-2000:]
    assert "not-the-password" not in log
    assert node.running


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_rediss_reaches_a_tls_only_redis(
    server_factory: ServerFactory, tmp_path: Path, pki: Pki
) -> None:
    tls = (pki.server_cert, pki.server_key, pki.ca)
    with RedisServer(
        tmp_path / "redis-tls", username="kvstore", password=PASSWORD, tls=tls
    ) as redis_tls:
        assert redis_tls.url.startswith("rediss://")
        node = server_factory("--redis-url", redis_tls.url)
        with node.client(data_plane="grpc") as client:
            client.put(KEYS, VALUES)
            poll(lambda: _stored_in_redis(redis_tls) >= len(KEYS), 5, "write-through over TLS")
            assert client.stats()["tiers"]["redis"]["up"] == 1
