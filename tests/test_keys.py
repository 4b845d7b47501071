"""Tests of the chained prefix-chunk keys in :mod:`kvstore.keys`.

A wrong key is silent corruption, so besides behaviour these tests recompute the scheme from its
written definition with ``hashlib`` / ``xxhash`` directly, and check that it does not depend on the
process (``PYTHONHASHSEED``). The exact bytes are pinned separately in ``test_keys_golden.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES, ChunkHasher, Namespace

C = 4  # a small chunk size keeps the chains readable

FULL_NAMESPACE = Namespace(
    model="meta-llama/Llama-3.1-8B",
    revision="abc123",
    num_layers=32,
    num_kv_heads=8,
    head_size=128,
    dtype="bfloat16",
    cache_layout="NHD",
    tp_rank=0,
    tp_size=2,
    lora_id="",
    tenant="acme",
    cache_salt="salt",
)

# One changed value per Namespace field, each valid on top of FULL_NAMESPACE.
FIELD_CHANGES: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-70B",
    "revision": "def456",
    "num_layers": 33,
    "num_kv_heads": 4,
    "head_size": 64,
    "dtype": "float16",
    "cache_layout": "HND",
    "tp_rank": 1,
    "tp_size": 4,
    "lora_id": "sql-adapter",
    "tenant": "globex",
    "cache_salt": "pepper",
}


def hasher(
    namespace: Namespace = FULL_NAMESPACE,
    chunk_size: int = C,
    secret: bytes = b"",
    algorithm: Any = "xxh3_128",
) -> ChunkHasher:
    return ChunkHasher(chunk_size, namespace, secret=secret, algorithm=algorithm)


# --- reference implementation, written from the documented scheme -------------------------------


def reference_fingerprint(namespace: Namespace) -> bytes:
    fields = dataclasses.asdict(namespace)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_digest(b"kvstore-namespace-v1\x00" + canonical)


def reference_keys(
    tokens: list[int], namespace: Namespace, chunk_size: int, secret: bytes, algorithm: str
) -> list[bytes]:
    def h(data: bytes) -> bytes:
        if algorithm == "sha256":
            return hashlib.sha256(data).digest()[:16]
        return xxhash.xxh3_128_digest(data)

    parent = h(
        b"kvstore-chain-v1\x00"
        + struct.pack("<Q", len(secret))
        + secret
        + reference_fingerprint(namespace)
    )
    keys = []
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        parent = h(parent + struct.pack(f"<{chunk_size}I", *chunk))
        keys.append(parent)
    return keys


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("secret", [b"", b"s3cr3t\x00with-nul"])
@pytest.mark.parametrize("namespace", [Namespace(model="m"), FULL_NAMESPACE])
def test_keys_match_documented_formula(namespace: Namespace, secret: bytes, algorithm: str) -> None:
    tokens = [0, 1, 255, 256, 65535, 65536, 2**24, 2**32 - 1, 7, 11, 13]  # byte order matters
    h = hasher(namespace, chunk_size=3, secret=secret, algorithm=algorithm)
    assert h.namespace_fingerprint == reference_fingerprint(namespace)
    assert h.keys(tokens) == reference_keys(tokens, namespace, 3, secret, algorithm)


# --- chaining -------------------------------------------------------------------------------------


def test_key_shape() -> None:
    keys = hasher().keys(list(range(4 * C)))
    assert len(keys) == 4
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4
    assert len(hasher().root) == KEY_BYTES
    assert hasher().root not in keys


@pytest.mark.parametrize("position", range(C))
def test_changing_chunk0_changes_every_key(position: int) -> None:
    tokens = list(range(100, 100 + 4 * C))
    changed = list(tokens)
    changed[position] += 1
    before, after = hasher().keys(tokens), hasher().keys(changed)
    assert all(a != b for a, b in zip(before, after, strict=True))


def test_changing_chunk2_leaves_earlier_keys_equal() -> None:
    tokens = list(range(100, 100 + 4 * C))
    changed = list(tokens)
    changed[2 * C + 1] = 9999
    before, after = hasher().keys(tokens), hasher().keys(changed)
    assert before[:2] == after[:2]
    assert before[2] != after[2]
    assert before[3] != after[3]  # chunk 3 is unchanged but its prefix is not


def test_key_is_of_prefix_not_of_chunk() -> None:
    # The same chunk tokens at another position (i.e. after another prefix) get another key.
    keys = hasher().keys([1, 2, 3, 4] * 3)
    assert len(set(keys)) == 3


def test_keys_of_prefix_are_prefix_of_keys() -> None:
    tokens = list(range(7 * C))
    full = hasher().keys(tokens)
    for n in range(len(tokens) + 1):
        assert hasher().keys(tokens[:n]) == full[: n // C]


@pytest.mark.parametrize("n", [0, 1, C - 1, C, C + 1, 2 * C - 1, 2 * C, 5 * C + 3])
def test_only_full_chunks_get_keys(n: int) -> None:
    assert len(hasher().keys(list(range(n)))) == n // C


def test_partial_tail_does_not_change_keys() -> None:
    tokens = list(range(2 * C))
    assert hasher().keys([*tokens, 5]) == hasher().keys(tokens)
    assert hasher().keys([*tokens, 6, 7, 8]) == hasher().keys(tokens)


def test_chunk_size_changes_keys() -> None:
    tokens = list(range(8))
    two_chunks = hasher(chunk_size=4).keys(tokens)
    one_chunk = hasher(chunk_size=8).keys(tokens)
    assert len(two_chunks) == 2 and len(one_chunk) == 1
    assert one_chunk[0] not in two_chunks


def test_default_chunk_size_is_256() -> None:
    h = ChunkHasher(namespace=Namespace(model="m"))
    assert h.chunk_size == 256
    assert len(h.keys(list(range(511)))) == 1
    assert len(h.keys(list(range(512)))) == 2


def test_largest_token_id_is_accepted_and_distinct() -> None:
    top = 2**32 - 1
    keys = hasher().keys([top] * C)
    assert keys == hasher().keys(np.full(C, top, dtype=np.uint32))
    assert keys != hasher().keys([top - 1] * C)
    assert keys != hasher().keys([0] * C)


# --- namespace ------------------------------------------------------------------------------------


def test_field_changes_cover_every_namespace_field() -> None:
    assert set(FIELD_CHANGES) == {f.name for f in dataclasses.fields(Namespace)}


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
def test_every_namespace_field_changes_fingerprint_and_keys(field: str) -> None:
    other = dataclasses.replace(FULL_NAMESPACE, **{field: FIELD_CHANGES[field]})
    assert getattr(other, field) != getattr(FULL_NAMESPACE, field)
    assert other.fingerprint() != FULL_NAMESPACE.fingerprint()
    tokens = list(range(3 * C))
    mine, theirs = hasher(FULL_NAMESPACE).keys(tokens), hasher(other).keys(tokens)
    assert hasher(FULL_NAMESPACE).root != hasher(other).root
    assert all(a != b for a, b in zip(mine, theirs, strict=True))


def test_fingerprint_is_stable_and_sized() -> None:
    copy = dataclasses.replace(FULL_NAMESPACE)
    assert copy is not FULL_NAMESPACE
    assert copy.fingerprint() == FULL_NAMESPACE.fingerprint()
    assert len(FULL_NAMESPACE.fingerprint()) == NAMESPACE_BYTES
    assert hasher(copy).keys(range(2 * C)) == hasher(FULL_NAMESPACE).keys(range(2 * C))


def test_fingerprint_binds_values_to_field_names() -> None:
    # Moving a value from one string field to another must not collide.
    a = Namespace(model="m", tenant="x", cache_salt="")
    b = Namespace(model="m", tenant="", cache_salt="x")
    c = Namespace(model="m", lora_id="x")
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


def test_model_only_namespace_equals_explicit_defaults() -> None:
    explicit = Namespace(
        model="m",
        revision="main",
        num_layers=0,
        num_kv_heads=0,
        head_size=0,
        dtype="auto",
        cache_layout="default",
        tp_rank=0,
        tp_size=1,
        lora_id="",
        tenant="",
        cache_salt="",
    )
    assert explicit.fingerprint() == Namespace(model="m").fingerprint()


def test_namespace_is_frozen_and_hashable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL_NAMESPACE.tenant = "other"  # type: ignore[misc]
    assert {FULL_NAMESPACE: 1}[dataclasses.replace(FULL_NAMESPACE)] == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"model": "m", "num_layers": -1},
        {"model": "m", "num_kv_heads": -1},
        {"model": "m", "head_size": -1},
        {"model": "m", "tp_rank": -1},
        {"model": "m", "tp_size": 0},
        {"model": "m", "tp_rank": 1, "tp_size": 1},
        {"model": "m", "tp_rank": 4, "tp_size": 4},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_invalid_namespace_raises_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Namespace(**kwargs)


def test_last_tp_rank_is_valid() -> None:
    assert Namespace(model="m", tp_rank=3, tp_size=4).tp_rank == 3


# --- secret and algorithm -------------------------------------------------------------------------


def test_secret_changes_root_and_every_key() -> None:
    tokens = list(range(3 * C))
    plain, keyed, other = hasher(), hasher(secret=b"alpha"), hasher(secret=b"beta")
    assert len({plain.root, keyed.root, other.root}) == 3
    for a, b, c in zip(plain.keys(tokens), keyed.keys(tokens), other.keys(tokens), strict=True):
        assert len({a, b, c}) == 3
    # The secret does not enter the namespace fingerprint (which is stored in block headers).
    assert plain.namespace_fingerprint == keyed.namespace_fingerprint


def test_empty_secret_is_the_default() -> None:
    explicit = ChunkHasher(C, FULL_NAMESPACE, secret=b"")
    assert explicit.keys(range(2 * C)) == ChunkHasher(C, FULL_NAMESPACE).keys(range(2 * C))


def test_default_algorithm_is_xxh3() -> None:
    default = ChunkHasher(C, FULL_NAMESPACE)
    assert default.algorithm == "xxh3_128"
    assert default.keys(range(C)) == hasher(algorithm="xxh3_128").keys(range(C))


def test_sha256_and_xxh3_give_different_16_byte_keys() -> None:
    tokens = list(range(3 * C))
    xxh, sha = hasher(algorithm="xxh3_128"), hasher(algorithm="sha256")
    assert xxh.root != sha.root
    for a, b in zip(xxh.keys(tokens), sha.keys(tokens), strict=True):
        assert len(a) == len(b) == KEY_BYTES
        assert a != b
    assert xxh.namespace_fingerprint == sha.namespace_fingerprint


# --- input types ----------------------------------------------------------------------------------

TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 32000, 128255, 2**31 - 1]  # fits int32


def _inputs() -> dict[str, Any]:
    strided = np.zeros(2 * len(TOKENS), dtype=np.uint32)
    strided[::2] = TOKENS
    return {
        "tuple": tuple(TOKENS),
        "int32": np.asarray(TOKENS, dtype=np.int32),
        "int64": np.asarray(TOKENS, dtype=np.int64),
        "uint32": np.asarray(TOKENS, dtype=np.uint32),
        "uint64": np.asarray(TOKENS, dtype=np.uint64),
        "big-endian": np.asarray(TOKENS, dtype=">i8"),
        "strided": strided[::2],
    }


@pytest.mark.parametrize("kind", list(_inputs()))
def test_array_inputs_match_list(kind: str) -> None:
    value = _inputs()[kind]
    assert hasher().keys(value) == hasher().keys(TOKENS)
    assert len(hasher().keys(value)) == len(TOKENS) // C


def test_range_input_matches_list() -> None:
    assert hasher().keys(range(10 * C)) == hasher().keys(list(range(10 * C)))


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_torch_tensor_input_matches_list(dtype: str) -> None:
    tokens = list(range(1000, 1000 + 5 * C + 2))
    tensor = torch.tensor(tokens, dtype=getattr(torch, dtype))
    assert hasher().keys(tensor) == hasher().keys(tokens)
    assert hasher().keys(tensor) == hasher().keys(np.asarray(tokens, dtype=dtype))
    # A non-contiguous view hashes its logical elements, not its storage.
    doubled = torch.tensor([t for t in tokens for _ in (0, 1)], dtype=getattr(torch, dtype))
    assert not doubled[::2].is_contiguous()
    assert hasher().keys(doubled[::2]) == hasher().keys(tokens)


def test_input_is_not_modified() -> None:
    array = np.asarray(TOKENS, dtype=np.int64)
    hasher().keys(array)
    assert array.dtype == np.int64
    assert array.tolist() == TOKENS


@pytest.mark.parametrize("empty", [[], (), np.array([], dtype=np.int64), np.array([])])
def test_empty_input_has_no_keys(empty: Any) -> None:
    assert hasher().keys(empty) == []


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([1, 2, -1, 4], id="negative-list"),
        pytest.param(np.array([1, 2, -1, 4], dtype=np.int32), id="negative-int32"),
        pytest.param([1, 2, 2**32, 4], id="2**32-list"),
        pytest.param(np.array([1, 2, 2**32, 4], dtype=np.int64), id="2**32-int64"),
        pytest.param(np.array([2**63], dtype=np.uint64), id="2**63-uint64"),
        pytest.param([1, 2**64, 3, 4], id="2**64-list"),
        pytest.param([1.0, 2.0, 3.0, 4.0], id="float-list"),
        pytest.param(np.arange(4, dtype=np.float32), id="float-array"),
        pytest.param([True, False, True, False], id="bool-list"),
        pytest.param(["1", "2", "3", "4"], id="str-list"),
        pytest.param([[1, 2], [3, 4]], id="2d-list"),
        pytest.param(np.arange(8).reshape(2, 4), id="2d-array"),
        pytest.param(7, id="scalar"),
    ],
)
def test_bad_token_ids_raise_invalid_request(bad: Any) -> None:
    with pytest.raises(InvalidRequestError):
        hasher().keys(bad)


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_bad_torch_tensors_raise_invalid_request(dtype: str) -> None:
    bad = {"float32": torch.arange(8, dtype=torch.float32), "int64": torch.arange(8).reshape(2, 4)}
    with pytest.raises(InvalidRequestError):
        hasher().keys(bad[dtype])


# --- constructor errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [0, -1, -256])
def test_bad_chunk_size_raises_config_error(chunk_size: int) -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        ChunkHasher(chunk_size, FULL_NAMESPACE)


def test_missing_namespace_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        ChunkHasher(C)
    with pytest.raises(ConfigError, match="namespace"):
        ChunkHasher(C, None)


@pytest.mark.parametrize("algorithm", ["md5", "xxh3", "SHA256", "xxh128", ""])
def test_bad_algorithm_raises_config_error_naming_choices(algorithm: str) -> None:
    with pytest.raises(ConfigError, match=r"sha256.*xxh3_128"):
        ChunkHasher(C, FULL_NAMESPACE, algorithm=algorithm)  # type: ignore[arg-type]


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        ChunkHasher(0, FULL_NAMESPACE)


# --- next_key -------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_next_key_chain_equals_keys(algorithm: str) -> None:
    h = hasher(secret=b"k", algorithm=algorithm)
    tokens = np.arange(500, 500 + 6 * C, dtype=np.int64)
    parent = h.root
    chained = []
    for i in range(6):
        parent = h.next_key(parent, tokens[i * C : (i + 1) * C])
        chained.append(parent)
    assert chained == h.keys(tokens)
    assert h.next_key(chained[2], list(tokens[3 * C : 4 * C])) == chained[3]


def test_next_key_depends_on_parent() -> None:
    h = hasher()
    keys = h.keys(range(2 * C))
    assert h.next_key(h.root, range(C, 2 * C)) != keys[1]
    assert h.next_key(keys[0], range(C, 2 * C)) == keys[1]


@pytest.mark.parametrize("length", [0, C - 1, C + 1, 2 * C])
def test_next_key_needs_exactly_one_chunk(length: int) -> None:
    h = hasher()
    with pytest.raises(InvalidRequestError):
        h.next_key(h.root, list(range(length)))


@pytest.mark.parametrize("bad", [[1, 2, 3, -4], [1, 2, 3, 2**32], [1.0, 2.0, 3.0, 4.0]])
def test_next_key_validates_tokens(bad: list[Any]) -> None:
    h = hasher()
    with pytest.raises(InvalidRequestError):
        h.next_key(h.root, bad)


# --- independence from the process ----------------------------------------------------------------

_CHILD = """
import sys
from kvstore.keys import ChunkHasher, Namespace
ns = Namespace(model="m", revision="r", num_layers=2, dtype="float16", tp_rank=1, tp_size=2,
               lora_id="l", tenant="t", cache_salt="s")
h = ChunkHasher(4, ns, secret=b"cross-process", algorithm=sys.argv[1])
print(h.namespace_fingerprint.hex(), *[k.hex() for k in h.keys(list(range(4 * 5 + 1)))])
"""


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_keys_are_identical_across_processes(algorithm: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, algorithm],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "4242")
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    ns = Namespace(
        model="m",
        revision="r",
        num_layers=2,
        dtype="float16",
        tp_rank=1,
        tp_size=2,
        lora_id="l",
        tenant="t",
        cache_salt="s",
    )
    h = ChunkHasher(4, ns, secret=b"cross-process", algorithm=algorithm)  # type: ignore[arg-type]
    here = [h.namespace_fingerprint.hex(), *[k.hex() for k in h.keys(list(range(21)))]]
    assert len(here) == 1 + 5
    assert outputs[0] == outputs[1] == here
