"""``/metrics`` of real ``kvstore serve`` processes, with a real redis-server (issue 14).

The done-when of the issue: after a short workload that includes a Redis outage, a corrupted
block and an eviction, ``/metrics`` shows each event under the right tier and reason. And the
endpoint follows the gRPC port's rules (tokens), is off with ``--metrics-listen ''``, and a port
already in use is a one-line error naming the setting.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from harness.block_forgery import rewrite_payload
from harness.certs import make_pki
from prometheus_client.parser import text_string_to_metric_families

from kvstore import ChunkHasher, KVStoreClient, Namespace

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer
from harness.serve import clean_env

NS = Namespace(model="metrics", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 64 * 1024
PREFIX = "kvstore:v1:"  # redis.key_prefix's default
TOKEN = "metrics-secret-token"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def blocks(seed: int, count: int) -> tuple[list[bytes], list[bytes]]:
    keys = HASHER.keys(list(range(seed * 10000, seed * 10000 + 16 * count)))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


def scrape(server: ServerProcess, token: str | None = None) -> Samples:
    """Every sample of the server's /metrics, by (name, labels)."""
    return scrape_text(server.metrics_url, token)


def _labels(**labels: str) -> frozenset[tuple[str, str]]:
    labels.setdefault("tenant", "")
    return frozenset(labels.items())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, _labels(**labels))]


def test_outage_corruption_and_eviction_show_under_their_tier_and_reason(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    with RedisServer(tmp_path / "redis") as redis_server:
        # No nvme and 1 MiB of dram (16 blocks): most blocks put leave the store, and live on in
        # Redis only.
        server = server_factory(
            "--redis-url", redis_server.url, "--nvme-path", "", "--dram-capacity", "1MiB"
        )
        assert server.metrics_url.startswith("http://127.0.0.1:")
        before = scrape(server)
        assert value(before, "kvstore_shared_tier_up") == 1
        assert value(before, "kvstore_misses_total", reason="corrupt") == 0
        # Redis has no capacity a node knows of: no series, rather than a fill ratio of 0.
        assert ("kvstore_tier_capacity_bytes", _labels(tier="redis")) not in before
        assert value(before, "kvstore_tier_capacity_bytes", tier="dram") == 1024**2

        keys, values = blocks(1, 40)
        raw = redis_server.client()
        names = [PREFIX + key.hex() for key in keys]
        with server.client(NS) as client:
            for start in range(0, len(keys), 8):
                assert client.put(keys[start : start + 8], values[start : start + 8]).stored == 8
            deadline = time.monotonic() + 10.0
            while None in (stored := raw.mget(names)):  # the write-through is asynchronous
                assert time.monotonic() < deadline, "write-through to redis not within 10 s"
                time.sleep(0.05)
            evicted = scrape(server)
            assert value(evicted, "kvstore_tier_evictions_total", tier="dram") >= 20
            assert value(evicted, "kvstore_tier_written_bytes_total", tier="redis") == (
                40 * BLOCK_BYTES
            )

            # A block rotted in Redis: a miss for reason corrupt, under tier redis.
            raw.set(names[0], rewrite_payload(stored[0], "mac"))
            # A block gone from Redis too (its TTL, say): evicted, since it left this store.
            raw.delete(names[1])
            assert client.get(keys[:3]) == [None, None, values[2]]
            served = scrape(server)
            assert value(served, "kvstore_tier_corrupt_blocks_total", tier="redis") == 1
            assert value(served, "kvstore_misses_total", reason="corrupt") == 1
            assert value(served, "kvstore_misses_total", reason="evicted") == 1
            assert value(served, "kvstore_tier_hits_total", tier="redis") == 1
            assert value(served, "kvstore_tier_read_bytes_total", tier="redis") == BLOCK_BYTES
            assert value(served, "kvstore_misses_total", reason="absent") == 0

            # Redis goes away: blocks only it held are misses for reason tier_down, and new
            # write-throughs wait in the re-send queue (none is lost: none counted dropped).
            redis_server.kill()
            assert client.get(keys[3:6]) == [None, None, None]
            other_keys, other_values = blocks(2, 4)
            assert client.put(other_keys, other_values).stored == 4
            assert client.get(blocks(3, 1)[0]) == [None]  # never stored anywhere
            deadline = time.monotonic() + 10.0
            while value(down := scrape(server), "kvstore_shared_write_queue_blocks") < 4:
                assert time.monotonic() < deadline, "refused write-throughs not queued in 10 s"
                time.sleep(0.05)
        assert value(down, "kvstore_shared_writes_dropped_total") == 0
        assert value(down, "kvstore_shared_tier_up") == 0
        assert value(down, "kvstore_misses_total", reason="tier_down") >= 2
        assert value(down, "kvstore_misses_total", reason="corrupt") == 1
        # The never-stored key: absent, or tier_down (Redis might have held it); never another.
        assert (
            value(down, "kvstore_misses_total", reason="absent")
            + value(down, "kvstore_misses_total", reason="tier_down")
            == 4
        )
        gets = sum(
            value(down, "kvstore_request_duration_seconds_count", op="get", plane=plane)
            for plane in ("grpc", "shm")
            if ("kvstore_request_duration_seconds_count", _labels(op="get", plane=plane)) in down
        )
        assert gets >= 3
        # kvstore stats shows the same figures: misses by reason, the hit rate per tier, the
        # shared tier's state.
        shown = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        reasons = next(line for line in lines if line.startswith("misses by reason:"))
        assert "corrupt 1" in reasons and "evicted 1" in reasons, reasons
        tier_down = int(reasons.split("tier_down ")[1].split()[0])
        assert tier_down == value(down, "kvstore_misses_total", reason="tier_down")
        assert lines[0].split()[5:7] == ["hit", "rate"]
        redis_row = next(line for line in lines if line.startswith("redis "))
        asked = sum(
            value(down, "kvstore_misses_total", reason=reason)
            for reason in ("absent", "evicted", "corrupt", "tier_down", "deadline", "namespace")
        ) + sum(value(down, "kvstore_tier_hits_total", tier=tier) for tier in ("dram", "redis"))
        assert f"{100 / asked:.1f}%" in redis_row.split(), (redis_row, asked)
        shared = next(line for line in lines if line.startswith("shared tier:"))
        assert "DOWN" in shared and "re-send queue 4 blocks" in shared, shared
        assert "not shared 0" in shared, shared
        raw.close()


@pytest.mark.each_plane
def test_lookups_and_durations_per_plane(server_factory: ServerFactory, data_plane: str) -> None:
    server = server_factory("--dram-capacity", "16MiB")
    keys, values = blocks(4, 3)
    with server.client(NS) as client:
        client.put(keys, values)
        assert client.lookup(keys) == 3
        assert client.lookup(keys) == 3
        assert client.get(keys) == values
    samples = scrape(server)
    if data_plane == "grpc":
        assert value(samples, "kvstore_lookups_total", plane="grpc") == 2
        durations = {"op": "lookup", "plane": "grpc"}
        assert value(samples, "kvstore_request_duration_seconds_count", **durations) == 2
        assert (
            value(samples, "kvstore_request_duration_seconds_bucket", le="10.0", **durations) == 2
        )
        assert value(samples, "kvstore_tier_read_bytes_total", tier="dram") == 3 * BLOCK_BYTES
    else:  # shared memory: answered by the server, or by the client from the published index
        planes = ("shm", "index")
        assert sum(value(samples, "kvstore_lookups_total", plane=p) for p in planes) == 2
    assert value(samples, "kvstore_tier_hits_total", tier="dram") == 3
    assert value(samples, "kvstore_tier_resident_blocks", tier="dram") == 3
    assert value(samples, "kvstore_tier_capacity_bytes", tier="dram") == 16 * 1024**2
    assert ("kvstore_build_info", frozenset({("version", "0.1.0")})) in samples


def test_metrics_need_a_listed_token_when_the_grpc_port_does(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {hashlib.sha256(TOKEN.encode()).hexdigest()}\n")
    server = server_factory("--tokens-file", str(tokens))
    for token in (None, "wrong"):
        try:
            scrape(server, token)
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        else:
            raise AssertionError(f"a scrape with token {token!r} was answered")
    assert value(scrape(server, TOKEN), "kvstore_tier_hits_total", tier="dram") == 0


def test_metrics_off_and_a_port_in_use(server_factory: ServerFactory, tmp_path: Path) -> None:
    off = server_factory("--metrics-listen", "")
    assert off.metrics_url == ""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "serve", "--nvme-path", "",
             "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, env=clean_env(),
        )  # fmt: skip
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "server.metrics_listen" in lines[0], done.stderr
    assert "--metrics-listen" in lines[0] and "Traceback" not in done.stderr


def test_beyond_loopback_without_authentication_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--nvme-path", "",
         "--listen", "127.0.0.1:0", "--metrics-listen", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert done.returncode != 0
    assert "server.metrics_listen" in done.stderr and "Traceback" not in done.stderr


def scrape_text(
    url: str, token: str | None = None, context: ssl.SSLContext | None = None
) -> Samples:
    """Every sample of /metrics at ``url``, by (name, labels), as ``token`` sees them."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def tenants_of(samples: Samples) -> set[str | None]:
    """The ``tenant`` label of every sample (``None``: a sample without one)."""
    return {dict(labels).get("tenant") for _, labels in samples}


def test_per_tenant_series_and_https_with_the_grpc_certificate(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """A tenant's token scrapes its own tenant's series only; ``auth.operators`` see all; a
    token of neither is refused (issue 28: bob read 121 series of tenant a)."""
    pki = make_pki(tmp_path / "pki")
    tokens = {"alice": "token-of-alice", "bob": "token-of-bob", "ops": "ops", "carol": "carol"}
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        "".join(f"{name} {hashlib.sha256(t.encode()).hexdigest()}\n" for name, t in tokens.items())
    )
    config = tmp_path / "tenants.toml"
    config.write_text(
        f'[auth]\ntokens_file = "{tokens_file}"\noperators = ["ops"]\n'
        '[tenants.a]\nidentities = ["alice"]\ndram = "16MiB"\nnvme = "16MiB"\n'
        '[tenants.b]\nidentities = ["bob"]\ndram = "16MiB"\nnvme = "16MiB"\n'
    )
    tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    server = server_factory("--config", str(config), *tls)
    assert server.metrics_url.startswith("https://127.0.0.1:")
    keys, values = blocks(5, 4)
    with KVStoreClient(
        server.target, namespace=NS, token=tokens["alice"], tls_ca=str(pki.ca)
    ) as alice:
        assert alice.put(keys, values).stored == 4
        assert alice.get(keys) == values
    context = ssl.create_default_context(cafile=str(pki.ca))
    resident = "kvstore_tier_resident_blocks"
    bob = scrape_text(server.metrics_url, tokens["bob"], context)
    # Only b's series, and the server's version: nothing of a's, nor the server-wide counts.
    assert tenants_of(bob) == {"b", None}
    assert {name for name, labels in bob if "tenant" not in dict(labels)} == {"kvstore_build_info"}
    assert value(bob, resident, tier="dram", tenant="b") == 0
    assert value(bob, "kvstore_tier_capacity_bytes", tier="dram", tenant="b") == 16 * 1024**2
    alice_sees = scrape_text(server.metrics_url, tokens["alice"], context)
    assert tenants_of(alice_sees) == {"a", None}
    assert value(alice_sees, resident, tier="dram", tenant="a") == 4
    assert any(
        name == "kvstore_request_duration_seconds_count" and dict(labels)["op"] == "put"
        for name, labels in alice_sees
    )
    ops = scrape_text(server.metrics_url, tokens["ops"], context)
    assert {"a", "b"} <= tenants_of(ops)
    assert value(ops, resident, tier="dram", tenant="a") == 4
    assert value(ops, resident, tier="dram", tenant="b") == 0
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape_text(server.metrics_url, tokens["carol"], context)
    assert refused.value.code == 403
    # Plain HTTP to the TLS port gets no answer (the handshake fails; no metrics in clear).
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(server.metrics_url.replace("https", "http"), timeout=10)


def test_a_client_certificate_scrapes_its_own_tenant(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """With client certificates and no tokens, the certificate's CN names the scraper's tenant,
    as it does on the gRPC port."""
    pki = make_pki(tmp_path / "pki")
    config = tmp_path / "tenants.toml"
    config.write_text(
        '[tenants.a]\nidentities = ["alice"]\ndram = "16MiB"\n'  # make_pki's client: CN alice
        '[tenants.b]\nidentities = ["bob"]\ndram = "16MiB"\n'
    )
    tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    server = server_factory("--config", str(config), *tls, "--tls-client-ca", str(pki.ca))
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    samples = scrape_text(server.metrics_url, context=context)
    assert tenants_of(samples) == {"a", None}
    assert value(samples, "kvstore_tier_capacity_bytes", tier="dram", tenant="a") == 16 * 1024**2
