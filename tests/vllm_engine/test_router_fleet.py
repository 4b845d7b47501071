"""``kvstore router`` in front of two real vLLM CPU replicas, end to end (issue 15, deliverable 4).

Each replica is vLLM's OpenAI API server with the kvstore connector pointed at its own
``kvstore serve`` node; both nodes publish to the cluster index in one real redis-server; the
router runs as a subprocess (:mod:`fleet`). The chunk size is set in one place, the nodes'
``keys.chunk_size`` (128, half the default): the connectors and the router have none of their
own. The router's provisional entries are made to expire at once, so where a request goes
depends on the index alone. In order, sharing one fleet:

1. conversations whose turns extend a growing prefix go back to the replica that holds them
   (the router's ``x-kvstore-replica`` header says which answered), and that replica reuses it;
   the router named their chunks by the scheme the nodes publish (its log line and metric);
2. a node SIGKILLed (its entries stay in Redis) and restarted (a new epoch) is not sent work on
   the strength of its old blocks: a replica that holds a shorter prefix, live, wins;
3. with Redis stopped, requests still succeed, routed by load, and the fallbacks are counted.

Needs vLLM's CPU build; skipped without it unless ``KVSTORE_REQUIRE_VLLM=1``. Runtime: about
a minute on two cores (55 s here), mostly the start-up of the two API servers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
from harness.vllm_fleet import CHUNK, Fleet, RouterProcess, build_model

from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.config import hash_secret
from kvstore.router import RouterKeys, parse_namespace

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PREFIX = "kvstore:cluster:v1:"
TURN_TOKENS = 300
CONVERSATIONS = 4
TURNS = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("fleet")
    built = Fleet(workdir, build_model(workdir))
    yield built
    built.close()


@pytest.fixture(scope="module")
def router(fleet: Fleet) -> RouterProcess:
    # Provisional entries expire at once: routing follows the cluster index alone. A slow
    # index answer on this busy machine must not turn into a fallback.
    env = {"KVSTORE_ROUTER_PROVISIONAL_TTL_S": "0.001", "KVSTORE_ROUTER_INDEX_TIMEOUT_S": "5"}
    return fleet.router(env=env)


def words(seed: int, count: int) -> list[int]:
    """``count`` token ids of the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(count)]


def chunk_keys(fleet: Fleet, prompt: list[int]) -> list[bytes]:
    """The index keys of ``prompt``'s whole chunks, as the router computes them."""
    return RouterKeys(parse_namespace(fleet.namespace), CHUNK, hash_secret()).keys(prompt)


def held(fleet: Fleet, prompt: list[int]) -> dict[str, int]:
    """Per live node in the index: how many of ``prompt``'s leading chunks it holds."""
    keys = chunk_keys(fleet, prompt)

    async def ask() -> dict[str, int]:
        client = connect(fleet.redis.url, 5.0)
        try:
            found = await ClusterIndex(client, Layout(PREFIX)).holders(keys)
            return {node: holding.leading for node, holding in found.items()}
        finally:
            await client.aclose()

    return asyncio.run(ask())


def wait_held(fleet: Fleet, prompt: list[int], node: str, chunks: int) -> None:
    """Until the index says ``node`` holds ``chunks`` leading chunks of ``prompt``; on time-out
    the failure says what Redis, the nodes and the connectors show (their logs go with the
    temporary directory)."""
    deadline = time.monotonic() + 60
    while held(fleet, prompt).get(node, 0) < chunks:
        if time.monotonic() > deadline:
            found = held(fleet, prompt)
            why = fleet.diagnose(chunk_keys(fleet, prompt), Layout(PREFIX))
            pytest.fail(f"{node}: {found} (want {chunks})\n{why}")
        time.sleep(0.2)


def node_of(fleet: Fleet, replica_url: str) -> str:
    return {s.url: n.node_id for s, n in zip(fleet.servers, fleet.nodes, strict=True)}[replica_url]


def test_conversations_go_back_to_the_replica_that_holds_them(
    fleet: Fleet, router: RouterProcess
) -> None:
    model = str(fleet.model)
    assert CHUNK != 256  # not the default: a part of the fleet that used it would show
    prompts = [words(100 + c, 2 * CHUNK + 40) for c in range(CONVERSATIONS)]
    owner: dict[int, str] = {}
    cache_before = sum(
        router.metric("kvstore_router_decisions_total", f'reason="prefix",replica="{s.url}"')
        for s in fleet.servers
    )
    for turn in range(TURNS):
        for conversation in range(CONVERSATIONS):
            reply = router.complete(model, prompts[conversation])
            assert reply.status == 200, reply.raw
            if turn == 0:
                owner[conversation] = reply.replica
            else:
                assert reply.replica == owner[conversation], (turn, conversation)
                # The replica reuses the previous turn's whole chunks at least.
                assert (
                    reply.cached_tokens
                    >= (len(prompts[conversation]) - TURN_TOKENS) // CHUNK * CHUNK
                )
            wait_held(
                fleet,
                prompts[conversation],
                node_of(fleet, reply.replica),
                len(prompts[conversation]) // CHUNK,
            )
        prompts = [p + words(1000 * turn + c, TURN_TOKENS) for c, p in enumerate(prompts)]
    # New conversations spread over both replicas (idle ties rotate); later turns follow the index.
    assert set(owner.values()) == {s.url for s in fleet.servers}
    cache_after = sum(
        router.metric("kvstore_router_decisions_total", f'reason="prefix",replica="{s.url}"')
        for s in fleet.servers
    )
    assert cache_after - cache_before == CONVERSATIONS * (TURNS - 1)
    # The router named those chunks by the nodes' published scheme, not by settings of its own.
    assert router.metric("kvstore_router_key_scheme_reads_total") >= 1
    log = router.log_text()
    assert f"naming chunks as the fleet does: chunk_size={CHUNK} hash=xxh3_128 " in log, log
    assert f"model={model!r}" in log, log
    assert "deprecated router.namespace" not in log and "refused for prefix routing" not in log


def test_a_restarted_node_is_not_trusted_on_its_old_blocks(
    fleet: Fleet, router: RouterProcess
) -> None:
    model = str(fleet.model)
    (server_x, node_x), (server_y, node_y) = zip(fleet.servers, fleet.nodes, strict=True)
    # Replica x holds a conversation of four chunks; replica y only its first two.
    long = words(7, 4 * CHUNK + 40)
    server_x.complete(model, long)
    server_y.complete(model, long[: 2 * CHUNK + 40])
    wait_held(fleet, long, node_x.node_id, 4)
    wait_held(fleet, long, node_y.node_id, 2)

    # x's node dies without cleaning up and comes back empty, under a new epoch.
    redis = fleet.redis.client()
    layout = Layout(PREFIX)
    old_epoch = redis.get(layout.lease(node_x.node_id))
    node_x.kill()
    node_x.start()
    deadline = time.monotonic() + 30
    while redis.get(layout.lease(node_x.node_id)) in (None, old_epoch):  # registers at start
        assert time.monotonic() < deadline, "the restarted node took no new epoch"
        time.sleep(0.1)
    # Its old entries are still in Redis; the index no longer counts them.
    keys = chunk_keys(fleet, long)
    assert all(redis.hexists(layout.entry(key), node_x.node_id) for key in keys)
    assert held(fleet, long) == {node_y.node_id: 2}

    before = router.metric(
        "kvstore_router_decisions_total", f'reason="prefix",replica="{server_y.url}"'
    )
    reply = router.complete(model, long + words(8, TURN_TOKENS))
    assert reply.status == 200, reply.raw
    assert reply.replica == server_y.url
    assert reply.cached_tokens >= 2 * CHUNK
    after = router.metric(
        "kvstore_router_decisions_total", f'reason="prefix",replica="{server_y.url}"'
    )
    assert after == before + 1


def test_with_redis_stopped_requests_are_routed_by_load(
    fleet: Fleet, router: RouterProcess
) -> None:
    model = str(fleet.model)

    def fallbacks() -> float:
        return sum(
            router.metric("kvstore_router_fallbacks_total", f'reason="{reason}"')
            for reason in ("index_timeout", "index_error", "index_down")
        )

    def by_load() -> float:  # routed without the index: by load and provisional entries
        return sum(
            router.metric("kvstore_router_decisions_total", f'reason="{reason}",replica="{s.url}"')
            for s in fleet.servers
            for reason in ("index_unavailable", "index_timeout")
        )

    before, load_before = fallbacks(), by_load()
    fleet.redis.kill()
    replies = [router.complete(model, words(500 + n, CHUNK + 10)) for n in range(4)]
    assert [r.status for r in replies] == [200] * 4, [r.raw for r in replies]
    assert {r.replica for r in replies} == {s.url for s in fleet.servers}
    assert fallbacks() - before == 4
    assert by_load() - load_before == 4
    assert router.metric("kvstore_router_index_errors_total") >= 1
