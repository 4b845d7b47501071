"""Nodes authenticate each other (issue 28, item 2), against real ``kvstore serve`` nodes, a real
redis-server and a rogue holder (:mod:`rogue_peer`) planted in the index as a process with write
access to its Redis would.

* A rogue entry whose description is unsigned, signed under another secret, or a real node's
  signed description with its address changed (copied under the rogue's id, or rewritten in
  place) is ignored: it never receives a request, let alone a credential, and never gets a byte
  served; the reader logs it once and counts it (``peer_unverified_nodes``).
* A rogue whose description passes (signed by the test with the cluster's secret: the worst
  case) receives a request carrying no token, only an authenticator naming the rogue, which node
  one refuses when the rogue relays it; the rogue cannot prove itself, so nothing it sent is read
  (``peer_unproven``) and node one serves the keys in the same request.
* A holder admits a peer read only with a fresh authenticator of exactly that request, holder,
  epoch and tenant under the cluster's secret, sealed, once: every other one is UNAUTHENTICATED,
  naming what failed, over ``KVStore.Get`` and ``UcxTransfer.UcxGet``; the server keeps serving.
* Two nodes whose gRPC ports require bearer tokens still serve each other peer hits, over UCX and
  over gRPC, with no peer token configured anywhere; with tenants, each tenant reads its own
  blocks (the authenticator names the tenant, under that tenant's key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from harness.cluster_nodes import NS, PREFIX, blocks_for, counters, grpc_client, holders, peer_env
from harness.index_records import CLUSTER_SECRET, described, plant, rewrite
from harness.polling import poll
from harness.rogue_peer import RoguePeer, put, rogue_first
from harness.tenant_config import NS as TENANT_NS
from harness.tenant_config import TOKENS as TENANT_TOKENS
from harness.tenant_config import blocks as tenant_blocks
from harness.tenant_config import write_config

from kvstore import KVStoreClient
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.block import Keyring
from kvstore.cluster.layout import Layout
from kvstore.cluster.records import NodeInfo
from kvstore.node.peer_auth import (
    CALL_METADATA,
    PeerCall,
    PeerSigner,
    peer_keyring,
    request_digest,
    sign_call,
)
from kvstore.protocol.ucx import ucx_unavailable_reason

if TYPE_CHECKING:
    from harness.redis_server import RedisServer
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

CLIENT_TOKEN = "node-auth-client-token"
PEER_RING = peer_keyring(Keyring([CLUSTER_SECRET.encode()]))
ROGUE_RING = peer_keyring(Keyring([b"not the cluster's secret"]))
needs_ucx = pytest.mark.skipif(ucx_unavailable_reason() is not None, reason="needs ucxx")


def reader_of(
    server_factory: ServerFactory, url: str, name: str, steady: bool = False, **extra: str
) -> ServerProcess:
    """A node reading its peers; ``steady``: with a lease long enough that it does not
    register again (rewriting its description) while a test changes that description, even on
    a loaded machine."""
    env = {**peer_env(url, name, "peers"), **extra}
    if steady:
        env["KVSTORE_CLUSTER_LEASE_TTL_S"] = "60"
    return server_factory(env=env)


@pytest.mark.parametrize("how", ["unsigned", "wrong secret", "copied readdressed", "in place"])
def test_a_rogue_entry_never_receives_a_request(
    server_factory: ServerFactory, redis_server: RedisServer, how: str
) -> None:
    url = redis_server.url
    redis = redis_server.client()
    one = reader_of(server_factory, url, "one", steady=True)
    shared, values = rogue_first(3)
    own, _ = blocks_for(60_000, 2)
    put(one, shared, values)
    poll(lambda: "one" in holders(url, shared), 5.0, "node one in the index")
    with RoguePeer() as rogue:
        real = redis.hgetall(Layout(PREFIX).node("one"))
        epoch = int(real[b"epoch"])
        if how in ("unsigned", "wrong secret"):
            secret = None if how == "unsigned" else "not the cluster's secret"
            plant(redis, PREFIX, NodeInfo("rogue", 1, rogue.target), shared + own, secret)
        elif how == "copied readdressed":  # node one's signed description, pointing at the rogue
            plant(redis, PREFIX, NodeInfo("rogue", epoch, rogue.target), shared + own, None)
            redis.hset(Layout(PREFIX).node("rogue"), mapping={**real, b"grpc": rogue.target})
        else:  # node one's own description, its MAC kept, its address changed
            redis.hset(Layout(PREFIX).node("one"), "grpc", rogue.target)
        three = reader_of(server_factory, url, "three")
        with grpc_client(three) as reader:
            got = reader.get(shared + own)
            again = reader.get(own)
        if how == "in place":
            assert got == [None] * (len(shared) + len(own))  # node one is not believed now
        else:
            assert got == [*values, *[None] * len(own)]  # from node one
        assert again == [None] * len(own)
        assert rogue.calls == []  # no request, no credential, no byte
    seen = counters(three)
    assert seen["peer_unverified_nodes"] == 1
    assert seen["peer_corrupt_blocks"] == 0
    assert three.stderr().count("ignoring node") == 1
    assert "Traceback" not in three.stderr()


def test_a_rogue_with_a_valid_description_learns_nothing_and_serves_nothing(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one = reader_of(server_factory, url, "one")
    shared, values = rogue_first(3)
    own, _ = blocks_for(60_000, 2)
    put(one, shared, values)
    poll(lambda: "one" in holders(url, shared), 5.0, "node one in the index")
    with RoguePeer() as rogue:
        info = NodeInfo("rogue", 1, rogue.target)
        plant(redis_server.client(), PREFIX, info, shared + own, CLUSTER_SECRET)
        # A left-over peer token is configured: it must not travel either.
        three = reader_of(server_factory, url, "three", KVSTORE_CLUSTER_PEER_TOKEN="left-over")
        with grpc_client(three) as reader:
            assert reader.get(shared) == values  # the rogue asked first: nothing of it read
            assert reader.get(own) == [None] * len(own)  # suspect: not asked again
        seen = counters(three)
        assert seen["peer_unproven"] == 1
        assert seen["peer_suspected"] == 1
        assert seen["peer_retries"] == len(shared)
        assert seen["peer_corrupt_blocks"] == 0
        assert "did not prove itself" in three.stderr()
        ((metadata, request),) = rogue.calls
    assert "authorization" not in metadata  # no token: nothing to collect
    relayed = PeerCall.parse(metadata[CALL_METADATA])
    assert relayed.holder == "rogue"
    # Relayed at once to node one, what the rogue got is refused there.
    with grpc.insecure_channel(one.target) as channel, pytest.raises(grpc.RpcError) as refused:
        peer_get(channel, request, relayed)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "names node 'rogue'" in (refused.value.details() or "")


def peer_get(
    channel: grpc.Channel, request: pb.GetRequest, call: PeerCall | None, token: str = ""
) -> tuple[list[pb.GetResult], Any]:
    """A ``Get`` as a peer makes it: its results and the answer's initial metadata."""
    metadata = [] if call is None else [(CALL_METADATA, call.metadata())]
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    answer = pb_grpc.KVStoreStub(channel).Get(request, metadata=metadata, timeout=5.0)
    results = [result for message in answer for result in message.results]
    return results, answer.initial_metadata()


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"tests {hashlib.sha256(CLIENT_TOKEN.encode()).hexdigest()}\n")
    return path


def token_node(
    factory: ServerFactory,
    url: str,
    name: str,
    tmp_path: Path,
    transport: str = "auto",
    **extra: str,
) -> ServerProcess:
    """A node whose callers need a bearer token (UCX on loopback where ucxx is installed)."""
    env = {**peer_env(url, name, "peers"), "KVSTORE_CLUSTER_PEER_TRANSPORT": transport, **extra}
    env["KVSTORE_CLUSTER_PEER_TIMEOUT_S"] = "8"  # a loaded machine's first UCX connect
    ucx = ("--ucx-listen", "127.0.0.1:0") if ucx_unavailable_reason() is None else ()
    return factory("--tokens-file", str(tokens_file(tmp_path)), *ucx, env=env)


def token_counters(node: ServerProcess) -> dict[str, int]:
    with node.client(NS, data_plane="grpc", timeout=3.0, token=CLIENT_TOKEN) as client:
        return dict(client.stats()["counters"])


def test_a_peer_read_needs_a_fresh_authenticator_of_its_own_request(
    server_factory: ServerFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    url = redis_server.url
    one = token_node(server_factory, url, "one", tmp_path)
    keys, values = blocks_for(0, 2)
    with one.client(NS, data_plane="grpc", timeout=3.0, token=CLIENT_TOKEN) as writer:
        assert writer.put(keys, values).stored == 2
    epoch = int(redis_server.client().get(Layout(PREFIX).lease("one")))
    ns = NS.fingerprint()
    request = pb.GetRequest(namespace=ns, keys=keys, sealed=True)
    digest = request_digest(ns, keys)

    def signed(**changes: Any) -> PeerCall:
        fields = {"ring": PEER_RING, "method": "Get", "tenant": "", "caller": "tests"}
        fields |= {"holder": "one", "epoch": epoch, "digest": digest, **changes}
        return sign_call(**fields)

    with grpc.insecure_channel(one.target) as channel:
        good = signed()
        results, initial = peer_get(channel, request, good)
        assert [r.value for r in results] == values and all(r.header for r in results)
        PeerSigner(PEER_RING, "", "tests").check(good, initial)  # the holder proved itself

        def refused(call: PeerCall | None, why: str, asked: pb.GetRequest = request) -> None:
            with pytest.raises(grpc.RpcError) as error:
                peer_get(channel, asked, call)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert why in (error.value.details() or ""), error.value.details()

        refused(good, "used before")  # replayed
        refused(signed(now=time.time() - 60), "clock")
        refused(signed(ring=ROGUE_RING), "does not verify")
        refused(signed(digest=request_digest(ns, keys[:1])), "does not verify")  # other keys
        refused(signed(epoch=epoch + 1), "names node")
        refused(signed(holder="two"), "names node")
        refused(signed(tenant="alice"), "not served here")
        unsealed = pb.GetRequest(namespace=ns, keys=keys)
        refused(signed(), "sealed", unsealed)
        tampered = dataclasses.replace(signed(), nonce=os.urandom(16))
        refused(tampered, "does not verify")
        # No authenticator, no token: what any other caller gets.
        with pytest.raises(grpc.RpcError) as error:
            peer_get(channel, request, None)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # An authenticator opens peer reads only, never another call.
        with pytest.raises(grpc.RpcError) as error:
            pb_grpc.KVStoreStub(channel).Stats(
                pb.StatsRequest(), metadata=[(CALL_METADATA, signed().metadata())], timeout=5.0
            )
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        if ucx_unavailable_reason() is None:
            ucx = ucx_pb_grpc.UcxTransferStub(channel)
            asked = ucx_pb.UcxGetRequest(
                namespace=ns, keys=keys, client_id=bytes(16), transfer_id=1, sealed=True
            )
            extra = asked.client_id + (1).to_bytes(8, "little")
            call = signed(method="UcxGet", digest=request_digest(ns, keys, extra))
            with pytest.raises(grpc.RpcError) as error:  # admitted: no such UCX endpoint here
                ucx.UcxGet(asked, metadata=[(CALL_METADATA, call.metadata())], timeout=5.0)
            assert error.value.code() == grpc.StatusCode.ABORTED
            other = signed(method="UcxGet", digest=request_digest(ns, keys))  # other endpoint
            with pytest.raises(grpc.RpcError) as error:
                ucx.UcxGet(asked, metadata=[(CALL_METADATA, other.metadata())], timeout=5.0)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with one.client(NS, data_plane="grpc", timeout=3.0, token=CLIENT_TOKEN) as client:
        assert client.get(keys) == values  # still serving
    assert "Traceback" not in one.stderr()


@needs_ucx
def test_nodes_requiring_tokens_serve_each_other_with_no_peer_token(
    server_factory: ServerFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    url = redis_server.url
    one = token_node(server_factory, url, "one", tmp_path)
    keys, values = blocks_for(0, 3)
    with one.client(NS, data_plane="grpc", timeout=3.0, token=CLIENT_TOKEN) as writer:
        assert writer.put(keys, values).stored == 3
    poll(lambda: "one" in holders(url, keys), 5.0, "node one in the index")
    for name, transport in (("three", "ucx"), ("four", "grpc")):  # no fallback either way
        # Four still sets the deprecated peer token: warned about at start, and ignored.
        extra = {"KVSTORE_CLUSTER_PEER_TOKEN": "left-over"} if name == "four" else {}
        reader = token_node(server_factory, url, name, tmp_path, transport, **extra)
        with reader.client(NS, data_plane="grpc", timeout=10.0, token=CLIENT_TOKEN) as client:
            assert client.get(keys) == values
        seen = token_counters(reader)
        assert seen[f"peer_hits_{transport}"] == len(keys), seen
        assert seen["peer_unverified_nodes"] == 0
        assert ("cluster.peer_token is deprecated" in reader.stderr()) == bool(extra)


def test_a_described_node_is_believed_only_while_its_signature_holds(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    """Node one's description re-signed by the cluster (as its renewals do) counts again."""
    url = redis_server.url
    redis = redis_server.client()
    one = reader_of(server_factory, url, "one", steady=True)
    keys, values = blocks_for(0, 2)
    put(one, keys, values)
    poll(lambda: "one" in holders(url, keys), 5.0, "node one in the index")
    info = described(redis, PREFIX, "one")
    rewrite(redis, PREFIX, info, "not the cluster's secret")
    three = reader_of(server_factory, url, "three")
    with grpc_client(three) as reader:
        assert reader.get(keys) == [None, None]
        rewrite(redis, PREFIX, info, CLUSTER_SECRET)

        def served() -> bool:
            return reader.get(keys) == values

        poll(served, 15.0, "node one believed again once re-signed")


def test_each_tenant_reads_its_own_blocks_from_peers(
    server_factory: ServerFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Per-tenant peer credentials: the same keys hold different blocks for tenants a and b on
    node one; node three reads each tenant's own from it, with no token between the nodes."""
    config = str(write_config(tmp_path))
    url = redis_server.url
    one, three = (
        server_factory("--config", config, env=peer_env(url, name, "peers"))
        for name in ("one", "three")
    )
    keys, a_values = tenant_blocks(1)
    _, b_values = tenant_blocks(2)
    for who, values in (("alice", a_values), ("bob", b_values)):
        with tenant_client(one, who) as writer:
            assert writer.put(keys, values).stored == len(keys)
    for who, values in (("alice", a_values), ("bob", b_values)):
        with tenant_client(three, who) as reader:
            poll(lambda r=reader, v=values: r.get(keys) == v, 10.0, f"{who}'s blocks via three")
            assert reader.stats()["counters"]["peer_hits"] == len(keys)
    assert "Traceback" not in one.stderr() + three.stderr()


def tenant_client(server: ServerProcess, who: str) -> Any:
    return KVStoreClient(
        server.target, namespace=TENANT_NS, token=TENANT_TOKENS[who], data_plane="grpc", timeout=5.0
    )
