"""Peer fetch, node loss and restart with every node on a host of its own (issue 16, 3 and 4).

Each ``kvstore serve`` runs in its own network namespace (:mod:`netns_hosts`), Redis listens on
the bridge's gateway address and the test's clients sit in the root namespace, so every byte
between nodes crosses a network path: no shared memory, no loopback shortcut. Nodes beyond
loopback authenticate their callers: each has a tokens file naming the test client's token; the
nodes' peer fetch presents no token but a per-request authenticator under keys derived from the
shared integrity secret (:mod:`kvstore.node.peer_auth`), which a server with tokens admits.

* A block put on node one is read bit-identical on node three, from node one (counters say so),
  and Redis holds the index only.
* Node one SIGKILLed (or SIGSTOPped: a hung node) while readers go through node three: every
  read ends within its deadline, never with wrong bytes; the index stops naming node one within
  its lease; the readers recompute (put the blocks on node three) and read them again.
* Node one cut off the network (packets dropped, not refused): the read ends at its deadline as a
  miss, node one is suspect and not asked again until its lease renews after the link is back.
* Node one restarted on its directory: a new epoch, and what LMDB kept is named and readable again.
* Nodes listening on every interface (all on one port, each in its host) publish the host they
  advertise (``cluster.advertise``); without it a node refuses to start.

Figures (worst read time, time until the index forgets a node) are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.cluster_nodes import LEASE_TTL_S, NS, blocks_for, holders, payload_keys, peer_env
from harness.netns_hosts import Host, Hosts
from harness.polling import poll

from kvstore import KVStoreClient
from kvstore.cluster import ClusterIndex, Layout, NodeInfo, connect
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.ports import free_port
from harness.redis_server import RedisServer

CLIENT_TOKEN = "client-token-for-tests"
#: The deadline of each read through node three.
DEADLINE_S = 1.0
#: What a read may take beyond its deadline: the client's own bookkeeping, not a peer's.
SLACK_S = 0.25


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with Hosts(3) as made:
        yield made


@pytest.fixture
def redis_server(tmp_path: Path, hosts: Hosts) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis", host=hosts.gateway) as server:
        yield server


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(
        "".join(
            f"{name} {hashlib.sha256(token.encode()).hexdigest()}\n"
            for name, token in (("tests", CLIENT_TOKEN),)
        )
    )
    return path


def node(
    server_factory: ServerFactory,
    host: Host,
    name: str,
    url: str,
    tokens: Path,
    dram_capacity: str = "64MiB",
) -> ServerProcess:
    """``kvstore serve`` named ``name`` on ``host``, reading other nodes' blocks from peers."""
    return server_factory(
        "--tokens-file",
        str(tokens),
        env=peer_env(url, name, "peers"),
        host=host,
        dram_capacity=dram_capacity,
    )


def client(server: ServerProcess, timeout: float = 3.0) -> KVStoreClient:
    # gRPC: the client is in the root namespace, the node in its own.
    return server.client(NS, data_plane="grpc", timeout=timeout, token=CLIENT_TOKEN)


def counters(server: ServerProcess) -> dict[str, int]:
    with client(server) as kv:
        return dict(kv.stats()["counters"])


def members(url: str) -> dict[str, NodeInfo]:
    """The live nodes as the index describes them."""

    async def ask() -> dict[str, NodeInfo]:
        redis = connect(url, 2.0)
        try:
            return await ClusterIndex(redis, Layout("kvstore:cluster:v1:")).nodes()
        finally:
            await redis.aclose()

    return asyncio.run(ask())


def named_on(url: str, name: str, keys: list[bytes]) -> bool:
    """Whether the index names node ``name`` for every one of ``keys``."""
    holding = holders(url, keys).get(name)
    return holding is not None and all(holding.tiers)


def test_a_block_crosses_hosts_from_the_peer_holding_it(
    hosts: Hosts, server_factory: ServerFactory, redis_server: RedisServer, tokens_file: Path
) -> None:
    url = redis_server.url
    one, two, three = (
        node(server_factory, host, name, url, tokens_file)
        for host, name in zip(hosts, ("one", "two", "three"), strict=True)
    )
    # Each node names the address it serves on inside its own host. A node whose first
    # registration timed out (a loaded machine) registers from the background: wait for it.
    poll(lambda: {"one", "two", "three"} <= members(url).keys(), 10.0, "every node registered")
    described = members(url)
    for server, host, name in zip((one, two, three), hosts, ("one", "two", "three"), strict=True):
        assert server.target.startswith(host.address + ":")
        assert described[name].grpc == server.target

    keys, values = blocks_for(0, 6)
    with client(one) as writer:
        assert writer.put(keys, values).stored == 6
    poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")
    with client(three) as reader:
        assert reader.get(keys) == values  # bit-identical, from another host
    after = counters(three)
    assert after["peer_hits"] == 6
    assert after["peer_bytes"] == sum(len(value) for value in values)
    assert counters(two).get("peer_requests", 0) == 0
    assert payload_keys(redis_server) == []


@dataclass
class Readers:
    """Threads reading groups of blocks through one node, recomputing (putting) what misses."""

    server: ServerProcess
    groups: list[tuple[list[bytes], list[bytes]]]
    threads: int = 4
    #: (start, end, blocks missed) per read.
    reads: list[tuple[float, float, int]] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    done: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> list[threading.Thread]:
        started = [
            threading.Thread(target=self._read, args=(offset,), daemon=True)
            for offset in range(self.threads)
        ]
        for thread in started:
            thread.start()
        return started

    def _read(self, offset: int) -> None:
        try:
            self._read_groups(offset)
        except Exception as exc:  # a reader that dies must fail the test, not thin the load
            with self._lock:
                self.wrong.append(f"reader {offset}: {type(exc).__name__} {exc}")

    def _read_groups(self, offset: int) -> None:
        with client(self.server, timeout=DEADLINE_S) as kv:
            for index in range(offset, len(self.groups), self.threads):
                keys, values = self.groups[index]
                start = time.monotonic()
                try:
                    got: list[bytes | None] = kv.get(keys, timeout=DEADLINE_S)
                except KVStoreError as exc:
                    got = []
                    with self._lock:
                        self.wrong.append(f"group {index}: {type(exc).__name__} {exc}")
                end = time.monotonic()
                misses = [i for i, payload in enumerate(got) if payload is None]
                bad = [i for i, payload in enumerate(got) if payload not in (None, values[i])]
                with self._lock:
                    self.reads.append((start, end, len(misses)))
                    if bad:
                        self.wrong.append(f"group {index}: wrong bytes at {bad}")
                    self.done += 1
                if misses:  # the engine recomputes the blocks and stores them itself
                    put = kv.put([keys[i] for i in misses], [values[i] for i in misses], timeout=10)
                    assert put.stored + put.already_present == len(misses)
                    with self._lock:
                        self.recomputed.append(index)
                time.sleep(0.01)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_node_lost_under_load_costs_bounded_misses_never_wrong_bytes(
    hosts: Hosts,
    server_factory: ServerFactory,
    redis_server: RedisServer,
    tokens_file: Path,
    how: signal.Signals,
) -> None:
    url = redis_server.url
    one = node(server_factory, hosts[0], "one", url, tokens_file)
    three = node(server_factory, hosts[2], "three", url, tokens_file)
    groups = [blocks_for(1_000 * index, 2) for index in range(160)]
    every = [key for keys, _ in groups for key in keys]
    with client(one, timeout=10.0) as writer:
        for keys, values in groups:
            assert writer.put(keys, values).stored == 2
    poll(lambda: named_on(url, "one", every), 10.0, "node one's blocks in the index")

    readers = Readers(three, groups)
    threads = readers.run()
    poll(lambda: readers.done >= len(groups) // 4, 30.0, "a quarter of the reads")
    # Killed: its port refuses at once. Frozen: its kernel still takes connections, but nothing
    # answers, so the reads in flight to it and the next ones can only end by their deadline.
    assert one.proc is not None
    one.proc.send_signal(how)
    killed = time.monotonic()
    poll(lambda: "one" not in holders(url, every), LEASE_TTL_S + 1.0, "node one out of the index")
    forgotten = time.monotonic() - killed
    for thread in threads:
        thread.join(timeout=60.0)
        assert not thread.is_alive(), "a reader hung"

    assert readers.wrong == []
    assert len(readers.reads) == len(groups)
    worst = max(end - start for start, end, _ in readers.reads)
    assert worst <= DEADLINE_S + SLACK_S
    after_kill = [misses for start, _, misses in readers.reads if start >= killed]
    missed = sum(after_kill)
    assert missed > 0, "the kill cost no read anything: the test did not test it"
    stats = counters(three)
    # Every miss is counted: asked and refused, skipped as suspect, or no longer indexed.
    assert stats["misses"] >= missed
    assert stats["miss_peer_down" if how == signal.SIGKILL else "miss_peer_timeout"] >= 1
    assert stats["peer_suspected"] >= 1

    # What the readers recomputed is on node three now: read again, every block hits.
    with client(three) as kv:
        for index in readers.recomputed:
            keys, values = groups[index]
            assert kv.get(keys) == values
    straddling = sum(1 for start, end, _ in readers.reads if start < killed < end)
    print(
        f"\nnode {how.name}: {len(readers.reads)} reads, {straddling} in flight at the kill, "
        f"{len(after_kill)} after it, {missed} "
        f"blocks missed; worst read {worst:.3f} s (deadline {DEADLINE_S} s); index forgot the "
        f"node {forgotten:.2f} s after the kill (lease {LEASE_TTL_S} s)"
    )


def test_a_partitioned_peer_is_a_miss_at_the_deadline_then_suspect_until_it_renews(
    hosts: Hosts, server_factory: ServerFactory, redis_server: RedisServer, tokens_file: Path
) -> None:
    url = redis_server.url
    one = node(server_factory, hosts[0], "one", url, tokens_file)
    three = node(server_factory, hosts[2], "three", url, tokens_file)
    groups = [blocks_for(1_000 * index, 2) for index in range(4)]
    with client(one) as writer:
        for keys, values in groups:
            assert writer.put(keys, values).stored == 2
    every = [key for keys, _ in groups for key in keys]
    poll(lambda: named_on(url, "one", every), 5.0, "node one's blocks in the index")
    with client(three, timeout=DEADLINE_S) as reader:
        assert reader.get(groups[0][0]) == groups[0][1]  # the channel to node one is up

        hosts.cut(hosts[0])  # node one drops every packet: no refusal, only silence
        start = time.monotonic()
        assert reader.get(groups[1][0], timeout=DEADLINE_S) == [None, None]
        took = time.monotonic() - start
        assert took <= DEADLINE_S + SLACK_S
        stats = counters(three)
        assert stats["miss_peer_timeout"] == 2
        assert stats["peer_suspected"] == 1
        asked = stats["peer_requests"]

        start = time.monotonic()
        assert reader.get(groups[2][0], timeout=DEADLINE_S) == [None, None]
        skipped = time.monotonic() - start
        assert counters(three)["peer_requests"] == asked  # suspect: not asked again

        hosts.mend(hosts[0])
        mended = time.monotonic()
        # Node one renews (or re-registers) its lease; node three asks it again.
        poll(
            lambda: reader.get(groups[3][0], timeout=DEADLINE_S) == groups[3][1],
            LEASE_TTL_S + 5.0,
            "node one asked again after its lease renewed",
        )
        back = time.monotonic() - mended
        assert counters(three)["peer_requests"] > asked
    print(
        f"\npartition: the read of a silent peer took {took:.3f} s (deadline {DEADLINE_S} s); "
        f"the next, skipping the suspect, {skipped * 1000:.1f} ms; node one served again "
        f"{back:.2f} s after its link came back (lease {LEASE_TTL_S} s)"
    )


def test_a_node_restarted_on_its_directory_rejoins_under_a_new_epoch_with_what_survived(
    hosts: Hosts, server_factory: ServerFactory, redis_server: RedisServer, tokens_file: Path
) -> None:
    url = redis_server.url
    # 1 MiB of dram: most of node one's blocks go down to LMDB, which outlives a SIGKILL.
    one = node(server_factory, hosts[0], "one", url, tokens_file, dram_capacity="1MiB")
    three = node(server_factory, hosts[2], "three", url, tokens_file)
    keys, values = blocks_for(0, 40)
    with client(one) as writer:
        assert writer.put(keys, values).stored == 40
        on_nvme = [i for i, tier in enumerate(writer.lookup_tiers(keys).tiers) if tier == "nvme"]
    assert len(on_nvme) >= 20
    poll(lambda: named_on(url, "one", keys), 5.0, "node one's blocks in the index")
    first_epoch = members(url)["one"].epoch
    with client(three) as reader:  # node three has talked to node one before its restart
        assert reader.get(keys[-1:]) == values[-1:]

    one.stop(signal.SIGKILL)
    one.start()  # same nvme directory, a new port
    poll(lambda: "one" in members(url), 5.0, "node one registered again")
    assert members(url)["one"].epoch == first_epoch + 1
    survived = [keys[i] for i in on_nvme]
    poll(lambda: named_on(url, "one", survived), 5.0, "node one's surviving blocks named again")
    asked = counters(three)["peer_hits"]
    with client(three) as reader:
        assert reader.get(survived) == [values[i] for i in on_nvme]
    assert counters(three)["peer_hits"] == asked + len(survived)


def test_nodes_on_every_interface_publish_the_host_they_advertise(
    hosts: Hosts, server_factory: ServerFactory, redis_server: RedisServer, tokens_file: Path
) -> None:
    url = redis_server.url
    port = free_port()  # the same port on every host, as a deployment would have it
    everywhere = ("--tokens-file", str(tokens_file), "--listen", f"0.0.0.0:{port}")
    # 0.0.0.0:PORT in the index would send every node that dials it to itself.
    with pytest.raises(RuntimeError, match=r"cluster\.advertise") as refused:
        server_factory(*everywhere, env=peer_env(url, "one", "peers"), host=hosts[0])
    assert "Traceback" not in str(refused.value)

    started = []
    for host, name in ((hosts[0], "one"), (hosts[2], "three")):
        env = {**peer_env(url, name, "peers"), "KVSTORE_CLUSTER_ADVERTISE": host.address}
        server = server_factory(*everywhere, env=env, host=host)
        assert server.target == f"0.0.0.0:{port}"
        server.target = f"{host.address}:{port}"  # where the test, outside, reaches it
        started.append(server)
    one, three = started
    poll(lambda: "one" in members(url), 10.0, "node one registered")
    assert members(url)["one"].grpc == f"{hosts[0].address}:{port}"
    keys, values = blocks_for(0, 3)
    with client(one) as writer:
        assert writer.put(keys, values).stored == 3
    poll(lambda: named_on(url, "one", keys), 5.0, "node one's blocks in the index")
    with client(three) as reader:
        assert reader.get(keys) == values
    assert counters(three)["peer_hits"] == 3
