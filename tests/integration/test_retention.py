"""Retention per request through a real ``kvstore serve``: the Put RPC and the shared-memory
RESERVE/COMMIT carry it, the server caps it (``policy.max_retention_s``,
``tenants.NAME.max_retention_s``), and the done-when of issue 31: a retained prefix is still a
hit after a flood that evicts a plain one; one that asked not to be stored never is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.retention_blocks import BLOCK, HOUR, NS, blocks, flood

from kvstore import InvalidRequestError, KVStoreClient, Retention

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory


@pytest.fixture
def small(server_factory: ServerFactory) -> ServerProcess:
    """4 MiB of dram and 8 MiB of nvme: a flood of 100 four-block prompts (100 MiB) evicts
    everything plain."""
    return server_factory(
        dram_capacity="4MiB", nvme_capacity="8MiB", env={"KVSTORE_POLICY_MAX_RETENTION_S": "7200"}
    )


@pytest.mark.each_plane
def test_a_retained_prefix_survives_a_flood_that_evicts_a_plain_one(small: ServerProcess) -> None:
    plain, plain_values = blocks(1, 2)
    pinned, pinned_values = blocks(2, 2)
    with small.client(NS) as client:
        assert client.put(plain, plain_values).stored == 2
        assert client.put(pinned, pinned_values, retention=HOUR).stored == 2
        flood(client, 100)
        assert client.lookup(plain) == 0
        assert client.lookup(pinned) == 2
        assert client.get(pinned) == pinned_values
        dram = client.stats()["tiers"]["dram"]
        assert dram["retained_blocks"] == 2 and dram["retained_evicted_early"] == 0


@pytest.mark.each_plane
def test_not_stored_is_never_a_hit(small: ServerProcess) -> None:
    keys, values = blocks(3, 3)
    with small.client(NS) as client:
        result = client.put(keys, values, retention=Retention(tiers="none"))
        assert (result.stored, result.already_present, result.dropped) == (0, 0, 0)
        assert client.lookup(keys) == 0 and client.get(keys) == [None] * 3
        assert client.stats()["blocks"] == 0


@pytest.mark.each_plane
def test_fast_only_stays_out_of_nvme(small: ServerProcess) -> None:
    keys, values = blocks(4, 2)
    with small.client(NS) as client:
        assert client.put(keys, values, retention=Retention(tiers="fast")).stored == 2
        flood(client, 40)
        assert client.lookup(keys) == 0  # dropped from dram, never demoted into nvme
        assert client.stats()["counters"]["fast_only_dropped"] >= 2


@pytest.mark.each_plane
def test_retention_over_the_maximum_is_refused(small: ServerProcess) -> None:
    keys, values = blocks(5, 2)
    with small.client(NS) as client:
        with pytest.raises(InvalidRequestError, match=r"policy\.max_retention_s"):
            client.put(keys, values, retention=Retention(7201))
        assert client.lookup(keys) == 0
        assert client.put(keys, values, retention=Retention(7200)).stored == 2


def test_a_reservation_committed_with_retention_is_retained(small: ServerProcess) -> None:
    keys, values = blocks(6, 2)
    with small.client(NS, data_plane="shm") as client:
        held = client.reserve(keys, [BLOCK] * 2, retention=HOUR)
        assert held is not None and held.states == ["reserved", "reserved"]
        for index, value in enumerate(values):
            held.write(index, value)
        assert held.commit().stored == 2
        flood(client, 100)
        assert client.get(keys) == values


def test_a_tenant_maximum_replaces_the_servers(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    token = "token-of-alice"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {hashlib.sha256(token.encode()).hexdigest()}\n")
    config = tmp_path / "tenants.toml"
    config.write_text(
        f'[auth]\ntokens_file = "{tokens}"\n'
        '[tenants.a]\nidentities = ["alice"]\ndram = "8MiB"\nnvme = "8MiB"\n'
        "max_retention_s = 300\n"
    )
    server = server_factory("--config", str(config))
    keys, values = blocks(7, 2)
    with KVStoreClient(server.target, namespace=NS, token=token) as client:
        with pytest.raises(InvalidRequestError, match=r"tenants\.a\.max_retention_s"):
            client.put(keys, values, retention=Retention(301))
        assert client.put(keys, values, retention=Retention(300)).stored == 2
        assert client.stats()["tiers"]["dram"]["retained_blocks"] == 2
