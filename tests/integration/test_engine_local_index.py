"""A node learning its engine's prefix cache from KV events: a real ``kvstore serve`` node, a real
redis-server and a real ZMQ PUB socket.

The PUB socket stands in for vLLM's ``ZmqEventPublisher``: this test builds batches in its wire
format (``[topic, seq, payload]``, ``payload`` the msgpack ``KVEventBatch`` array ``[ts, events,
dp_rank]`` whose events are maps tagged ``type``), the way ``msgspec`` encodes vLLM 0.32's
structs; ``tests/vllm_engine/test_engine_events.py`` checks the real publisher of a real engine.

What it shows, with vLLM's blocks of 16 tokens and kvstore chunks of 32: the whole chunks an
engine holds appear in the index as tier ``local`` of the node beside it, named as the connector
names them (cache salt included), and a partial chunk never does; a node's own tier shows again
once the engine drops a chunk; a removed block withdraws its chunks and its descendants'; a
sequence gap, an undecodable batch, ``AllBlocksCleared`` and the engine's connection closing
each drop everything learnt; the remembered blocks are bounded.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import zmq
from harness.cluster_nodes import holders
from harness.polling import poll
from harness.ports import free_port

from kvstore import ChunkHasher, Namespace
from kvstore.cluster import Holding

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory


from harness.redis_server import RedisServer

NS = Namespace(model="engine-events", num_layers=2, num_kv_heads=2, head_size=64)
SECRET = "engine-events-secret"
CHUNK = 32
BLOCK = 16
MAX_BLOCKS = 12


def hasher(salt: str = "") -> ChunkHasher:
    return ChunkHasher(CHUNK, NS.for_request("", salt), secret=SECRET.encode())


def block_hash(tokens: list[int], salt: str = "") -> bytes:
    """A stand-in for vLLM's block hash of a prefix (any stable function of it will do)."""
    return hashlib.sha256(f"{salt}:{tokens}".encode()).digest()


class FakeEnginePublisher:
    """vLLM's publisher's wire format on a real PUB socket (see the module docstring)."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.bind(endpoint)
        self.seq = 0

    def send(self, events: list[dict[str, Any]], *, skip: int = 0) -> None:
        self.seq += skip
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def send_raw(self, payload: bytes) -> None:
        self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.socket.close(linger=0)


def stored(prompt: list[int], first: int, count: int, salt: str = "") -> dict[str, Any]:
    """vLLM's ``BlockStored`` for blocks ``first .. first+count`` of ``prompt``."""
    hashes = [block_hash(prompt[: (i + 1) * BLOCK], salt) for i in range(first, first + count)]
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": block_hash(prompt[: first * BLOCK], salt) if first else None,
        "token_ids": prompt[first * BLOCK : (first + count) * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    if salt:
        event["extra_keys"] = [[salt] if first + i == 0 else None for i in range(count)]
    return event


def removed(prompt: list[int], index: int) -> dict[str, Any]:
    hashes = [block_hash(prompt[: (index + 1) * BLOCK])]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def tiers(url: str, keys: list[bytes]) -> list[str]:
    return holders(url, keys).get("n", Holding(0, [""] * len(keys))).tiers


def test_engine_chunks_are_local_whole_and_withdrawn(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEnginePublisher(endpoint)
    env = {
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_CLUSTER_URL": url,
        "KVSTORE_CLUSTER_NODE_ID": "n",
        "KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "0.05",
        "KVSTORE_CLUSTER_ENGINE_EVENTS": endpoint,
        "KVSTORE_KEYS_NAMESPACE": json.dumps(
            {"model": NS.model, "num_layers": 2, "num_kv_heads": 2, "head_size": 64}
        ),
        "KVSTORE_KEYS_CHUNK_SIZE": str(CHUNK),
        "KVSTORE_CLUSTER_ENGINE_MAX_BLOCKS": str(MAX_BLOCKS),
        "KVSTORE_HASH_SECRET": SECRET,
    }
    node = server_factory(env=env)
    try:
        # A probe prompt, sent until the node's subscription is up (PUB drops what is sent
        # before a subscriber joins); each resend is a new batch, as the engine's would be.
        probe = list(range(5000, 5000 + CHUNK))
        probe_keys = hasher().keys(probe)
        deadline = time.monotonic() + 15
        while tiers(url, probe_keys) != ["local"]:
            assert time.monotonic() < deadline, "the node never heard the engine"
            engine.send([stored(probe, 0, 2)])
            time.sleep(0.1)

        # 5 blocks of 16 = 80 tokens: chunks 0 and 1 are whole, chunk 2 (64..96) is not. Sent
        # as vLLM does, in two events (the second continues the first's chain).
        prompt = list(range(1, 97))
        keys = hasher().keys(prompt)
        engine.send([stored(prompt, 0, 3), stored(prompt, 3, 2)])
        poll(lambda: tiers(url, keys) == ["local", "local", ""], 10.0, "the whole chunks as local")

        # A cache salt is part of the connector's names; the same tokens unsalted are not held.
        salted = list(range(200, 264))
        salted_keys = hasher("s1").keys(salted)
        engine.send([stored(salted, 0, 4, salt="s1")])
        poll(lambda: tiers(url, salted_keys) == ["local"] * 2, 10.0, "the salted chunks")
        assert tiers(url, hasher().keys(salted)) == ["", ""]

        # The node's own tier shows once the engine drops a chunk it also stores.
        with node.client(NS) as client:
            value = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
            assert client.put(keys[:1], [value]).stored == 1
        # Its change, had it been queued for the index, goes out no later than the next one:
        # withdrawing the probe, and seeing it gone, shows the node published after the put.
        engine.send([removed(probe, 0)])
        poll(lambda: tiers(url, probe_keys) == [""], 10.0, "the probe withdrawn after the put")
        assert tiers(url, keys) == ["local", "local", ""]
        engine.send([stored(probe, 0, 2)])  # back, for the sequence gap below to drop
        poll(lambda: tiers(url, probe_keys) == ["local"], 10.0, "the probe again")
        # Removing block 2 (the first of chunk 1) withdraws chunk 1; chunk 0 stays.
        engine.send([removed(prompt, 2)])
        poll(lambda: tiers(url, keys) == ["local", "", ""], 10.0, "chunk 1 withdrawn")
        # Removing block 0 withdraws everything after it: chunk 0 is now only in dram.
        engine.send([removed(prompt, 0)])
        poll(lambda: tiers(url, keys) == ["dram", "", ""], 10.0, "the node's own tier again")

        # A lost batch (sequence gap) drops everything learnt, then learning starts again.
        engine.send([stored(prompt, 0, 4)], skip=1)
        poll(lambda: tiers(url, salted_keys) == ["", ""], 10.0, "the gap dropping what was learnt")
        assert tiers(url, probe_keys) == [""]
        assert tiers(url, keys) == ["local", "local", ""]  # the batch after the gap counts

        # An undecodable batch drops everything too.
        engine.send_raw(b"\xc1 not msgpack")
        poll(
            lambda: tiers(url, keys) == ["dram", "", ""], 10.0, "an undecodable batch dropping all"
        )

        # AllBlocksCleared.
        engine.send([stored(salted, 0, 4, salt="s1")])
        poll(lambda: tiers(url, salted_keys) == ["local"] * 2, 10.0, "the salted chunks again")
        engine.send([{"type": "AllBlocksCleared"}])
        poll(lambda: tiers(url, salted_keys) == ["", ""], 10.0, "AllBlocksCleared")

        # Bounded: 12 blocks at most. 8 blocks of one prompt, then 8 of another: the oldest
        # blocks (the first prompt's start) are forgotten, and every chunk after them with them.
        long_a, long_b = list(range(1000, 1128)), list(range(3000, 3128))
        keys_a, keys_b = hasher().keys(long_a), hasher().keys(long_b)
        engine.send([stored(long_a, 0, 8)])
        poll(lambda: tiers(url, keys_a) == ["local"] * 4, 10.0, "the first long prompt")
        engine.send([stored(long_b, 0, 8)])
        poll(lambda: tiers(url, keys_b) == ["local"] * 4, 10.0, "the second long prompt")
        poll(lambda: tiers(url, keys_a) == [""] * 4, 10.0, "the first one forgotten")

        # The engine going away (its connection closing) drops everything it told.
        engine.close()
        poll(lambda: tiers(url, keys_b) == [""] * 4, 10.0, "the engine's chunks after it left")
    finally:
        engine.close()
    assert node.running
    node.stop(signal.SIGTERM)
    assert "sequence gap" in node.stderr() and "undecodable" in node.stderr()
