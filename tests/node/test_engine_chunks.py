"""Engine blocks to kvstore chunk keys (:class:`kvstore.cluster.EngineChunks`) and the
``cluster.engine_*`` settings. The node consuming a real event stream is
``tests/integration/test_engine_local_index.py``."""

from __future__ import annotations

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.keys import ChunkHasher, Namespace
from kvstore.node import EngineChunks
from kvstore.node.engine_chunks import StoredBlocks

NS = Namespace(model="engine-chunks")


def chunks(chunk_size: int, max_blocks: int = 1000) -> tuple[EngineChunks, list[bytes]]:
    log: list[bytes] = []
    engine = EngineChunks(
        NS, chunk_size, b"s", log.append, lambda key: log.remove(key), max_blocks=max_blocks
    )
    return engine, log


def event(tokens: list[int], first: int, count: int, size: int, **extra: object) -> StoredBlocks:
    """Blocks ``first .. first+count`` of ``tokens``, hashed by ints (as with vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    hashes = [hash(tuple(tokens[: (i + 1) * size])) for i in range(first, first + count)]
    parent = hash(tuple(tokens[: first * size])) if first else None
    return StoredBlocks(
        hashes,
        parent,
        tokens[first * size : (first + count) * size],
        size,
        **extra,  # type: ignore[arg-type]
    )


def test_chunks_not_a_multiple_of_blocks_are_named_once_whole() -> None:
    engine, held = chunks(24)
    tokens = list(range(7, 7 + 16 * 7))  # 112 tokens: 4 whole chunks of 24 (96), 16 left over
    expected = [bytes(k) for k in ChunkHasher(24, NS, secret=b"s").keys(tokens)]
    for first in range(7):  # one block per event, as a decode step caches them
        engine.stored(event(tokens, first, 1, 16))
        assert held == expected[: (first + 1) * 16 // 24]
    assert len(expected) == 4 and held == expected
    # Block 3 (tokens 48..64) starts chunk 2: removing it withdraws chunks 2 and 3.
    engine.removed([hash(tuple(tokens[:64]))])
    assert held == expected[:2]
    # The same blocks again: learnt again, nothing twice.
    engine.stored(event(tokens, 3, 4, 16))
    assert held == expected


def test_what_cannot_be_named_is_never_claimed() -> None:
    engine, held = chunks(16)
    tokens = list(range(64))
    engine.stored(event(tokens, 1, 3, 16))  # parent unknown: learnt before we listened
    engine.stored(event(tokens, 0, 4, 16, lora_name="adapter"))  # LoRA: named by name@path
    engine.stored(event(tokens, 0, 1, 16, extra_keys=[[["mm-hash", 0]]]))  # multimodal
    engine.stored(event(tokens, 0, 1, 16, group=1))  # a second KV cache group
    # Tokens that do not split into the blocks (masked blocks left out): not named either.
    engine.stored(StoredBlocks([1, 2], None, list(range(20)), 16))
    assert held == [] and len(engine) == 0


def test_a_hybrid_engine_is_followed_in_its_full_attention_group() -> None:
    """gpt-oss under vLLM's hybrid manager: group 0 sliding, group 1 full attention."""
    engine, held = chunks(16)
    tokens = list(range(64))
    expected = [bytes(k) for k in ChunkHasher(16, NS, secret=b"s").keys(tokens)]
    # The sliding group's events (its masked blocks left out) name nothing ...
    engine.stored(event(tokens, 2, 2, 16, group=0, kind="sliding_window"))
    assert held == [] and engine.group is None
    # ... the full-attention group's name the chunks.
    engine.stored(event(tokens, 0, 4, 16, group=1, kind="full_attention"))
    assert held == expected and engine.group == 1
    assert engine.other_groups == {"sliding_window": 2}
    # The window evicted: the full-attention chunks stay claimed (a partial hit, not a miss).
    engine.removed([hash(tuple(tokens[:48])), hash(tuple(tokens[:64]))], group=0)
    assert held == expected
    # A full-attention block evicted: its chunk and those after it go.
    engine.removed([hash(tuple(tokens[:48]))], group=1)
    assert held == expected[:2]
    # Another full-attention group (a second one) does not change what is claimed.
    engine.stored(event(tokens, 0, 4, 16, group=2, kind="full_attention"))
    assert held == expected[:2]


def test_an_engine_whose_events_name_no_kind_is_followed_in_group_0() -> None:
    engine, held = chunks(16)
    tokens = list(range(32))
    engine.stored(event(tokens, 0, 2, 16, group=0))
    assert len(held) == 2 and engine.group is None
    engine.removed([hash(tuple(tokens[:32]))], group=0)
    assert len(held) == 1


def test_bounded_and_cleared() -> None:
    engine, held = chunks(16, max_blocks=3)
    first, second = list(range(48)), list(range(100, 132))
    engine.stored(event(first, 0, 3, 16))
    assert len(held) == 3
    engine.stored(event(second, 0, 2, 16))  # the oldest block goes, and its chain with it
    assert len(engine) == 2 and held == [
        bytes(k) for k in ChunkHasher(16, NS, secret=b"s").keys(second)
    ]
    engine.clear()
    assert held == [] and len(engine) == 0


def test_engine_settings_errors_name_the_setting() -> None:
    base = {"KVSTORE_CLUSTER_ENABLED": "1", "KVSTORE_CLUSTER_URL": "redis://127.0.0.1:1"}
    on = {**base, "KVSTORE_CLUSTER_ENGINE_EVENTS": "tcp://127.0.0.1:5557"}
    namespace = '{"model": "m"}'
    with pytest.raises(ConfigError, match=r"cluster\.engine_events must be empty or start with"):
        load_config(env={**base, "KVSTORE_CLUSTER_ENGINE_EVENTS": "127.0.0.1:5557"})
    # No namespace: the node waits for its engine's connector to declare one.
    assert load_config(env=on).keys.namespace == ""
    with pytest.raises(ConfigError, match=r"cluster.engine_namespace: unknown fields \['modle'\]"):
        load_config(env={**on, "KVSTORE_CLUSTER_ENGINE_NAMESPACE": '{"modle": "m"}'})
    with pytest.raises(ConfigError, match=r"needs cluster\.enabled = true"):
        load_config(
            env={
                **on,
                "KVSTORE_CLUSTER_ENABLED": "0",
                "KVSTORE_CLUSTER_ENGINE_NAMESPACE": namespace,
            }
        )
    with pytest.raises(ConfigError, match=r"cluster\.engine_hash_algorithm must be one of"):
        load_config(
            env={
                **on,
                "KVSTORE_CLUSTER_ENGINE_NAMESPACE": namespace,
                "KVSTORE_CLUSTER_ENGINE_HASH_ALGORITHM": "md5",
            }
        )
    config = load_config(env={**on, "KVSTORE_CLUSTER_ENGINE_NAMESPACE": namespace})
    assert config.cluster.engine_events == "tcp://127.0.0.1:5557"
    assert config.keys.chunk_size == 256 and config.keys.namespace == namespace
