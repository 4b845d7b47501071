"""Retention survives a restart of a real ``kvstore serve`` (issue 41): a retained prompt keeps its
hits after the node restarts and a flood of one-off prompts, its deadline restored from the nvme
directory; and a retained put of a prompt already stored lengthens its TTL in a real Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.polling import poll
from harness.redis_server import RedisServer
from harness.retention_blocks import HOUR, NS, blocks, flood

from kvstore import Retention

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

REDIS_TTL_S = 60


def local_tiers(client: object, keys: list[bytes]) -> list[str]:
    return list(client.lookup_tiers(keys).tiers)  # type: ignore[attr-defined]


def test_a_retained_prompt_keeps_its_hits_across_a_restart(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    node = server_factory(
        dram_capacity="4MiB",
        nvme_capacity="8MiB",
        env={
            "KVSTORE_POLICY_MAX_RETENTION_S": "7200",
            "KVSTORE_REDIS_URL": redis_server.url,
            "KVSTORE_REDIS_TTL_S": str(REDIS_TTL_S),
            "KVSTORE_INTEGRITY_SECRETS": "retention restart secret",
        },
    )
    pinned, pinned_values = blocks(21, 2)
    plain, plain_values = blocks(22, 2)
    with node.client(NS, data_plane="grpc") as client:
        assert client.put(pinned, pinned_values, retention=HOUR).stored == 2
        assert client.put(plain, plain_values).stored == 2
    node.restart()  # SIGTERM: what is only in dram is saved to nvme, then the process ends

    with node.client(NS, data_plane="grpc") as client:
        assert client.stats()["tiers"]["nvme"]["retained_blocks"] == 2
        flood(client, 100)  # 100 MiB of one-off prompts through 12 MiB of local tiers
        # Still held on this node (not merely in Redis), and bit-identical.
        assert all(tier in ("dram", "nvme") for tier in local_tiers(client, pinned))
        assert client.get(pinned) == pinned_values
        assert not any(tier in ("dram", "nvme") for tier in local_tiers(client, plain))

    # A retained put of a prompt this node holds already: nothing stored again, and its copy
    # in Redis (written through with the tier's TTL) now lives as long as the retention asks.
    again, again_values = blocks(23, 2)
    names = [b"kvstore:v1:" + key.hex().encode() for key in again]
    redis = redis_server.client()
    with node.client(NS, data_plane="grpc") as client:
        assert client.put(again, again_values).stored == 2
        poll(lambda: all(redis.pttl(name) > 0 for name in names), 10.0, "write-through")
        assert all(redis.pttl(name) <= REDIS_TTL_S * 1000 for name in names)
        result = client.put(again, again_values, retention=Retention(1800))
        assert (result.stored, result.already_present) == (0, 2)
        poll(
            lambda: all(redis.pttl(name) > REDIS_TTL_S * 1000 for name in names),
            10.0,
            "the Redis TTL lengthened",
        )
        assert client.stats()["tiers"]["redis"]["retained_blocks_extended"] == 2


def test_a_retained_prompt_survives_a_kill(server_factory: ServerFactory) -> None:
    node = server_factory(
        dram_capacity="4MiB",
        nvme_capacity="8MiB",
        env={"KVSTORE_POLICY_MAX_RETENTION_S": "7200"},
    )
    pinned, pinned_values = blocks(31, 2)
    with node.client(NS, data_plane="grpc") as client:
        assert client.put(pinned, pinned_values, retention=HOUR).stored == 2
        # Copied to disk beside its deadline as soon as it was put (in the background).
        poll(
            lambda: client.stats()["tiers"]["nvme"]["retained_blocks"] == 2,
            10.0,
            "the retained blocks on nvme",
        )
    node.kill()  # no graceful stop: nothing is saved on the way out
    node.start()
    with node.client(NS, data_plane="grpc") as client:
        assert client.stats()["tiers"]["nvme"]["retained_blocks"] == 2
        flood(client, 100)
        assert client.lookup(pinned) == 2
        assert client.get(pinned) == pinned_values
