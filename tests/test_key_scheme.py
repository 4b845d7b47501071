"""KeyScheme: one value for how chunks are named (issue 29 item 2)."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.key_scheme import KeyScheme, secret_fingerprint
from kvstore.keys import ChunkHasher, Namespace

BASE = Namespace(model="org/model", num_layers=2, tenant="acme")


def test_round_trips_through_json() -> None:
    scheme = KeyScheme.with_secret(BASE, 128, "sha256", env={"KVSTORE_HASH_SECRET": "s3"})
    again = KeyScheme.from_json(scheme.to_json(), "test")
    assert again == scheme
    assert again.differences(scheme) == []


def test_names_chunks_as_a_hasher_of_the_same_settings() -> None:
    scheme = KeyScheme.with_secret(BASE, 4, env={"KVSTORE_HASH_SECRET": "s3"})
    secret = scheme.secret({"KVSTORE_HASH_SECRET": "s3"})
    direct = ChunkHasher(4, BASE.for_request("lora", "salt"), secret=b"s3")
    tokens = list(range(12))
    assert scheme.hasher(secret, "lora", "salt").keys(tokens) == direct.keys(tokens)


def test_differences_name_each_field() -> None:
    mine = KeyScheme.with_secret(BASE, 256, env={"KVSTORE_HASH_SECRET": "a"})
    theirs = KeyScheme.with_secret(
        Namespace(model="org/model", num_layers=3, tenant="acme"),
        512,
        "sha256",
        env={"KVSTORE_HASH_SECRET": "b"},
    )
    found = mine.differences(theirs)
    assert "chunk_size 256 vs 512" in found
    assert "hash_algorithm xxh3_128 vs sha256" in found
    assert any(item.startswith("secret") for item in found)
    assert "namespace.num_layers 2 vs 3" in found
    # A party without a namespace yet differs in nothing else.
    assert KeyScheme(None, 256, secret_check=mine.secret_check).differences(mine) == []


def test_a_changed_secret_is_refused() -> None:
    scheme = KeyScheme.with_secret(BASE, env={"KVSTORE_HASH_SECRET": "old"})
    with pytest.raises(ConfigError, match=r"\$KVSTORE_HASH_SECRET does not hold"):
        scheme.secret({"KVSTORE_HASH_SECRET": "new"})
    assert secret_fingerprint("old") == scheme.secret_check != secret_fingerprint("new")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "not a key scheme"),
        ('{"chunk_size": 0}', "keys.chunk_size must be >= 1"),
        ('{"hash_algorithm": "md5"}', "keys.hash_algorithm must be one of"),
        ('{"namespace": {"model": "m", "lora_id": "x"}}', "filled per request"),
        ('{"namespace": {"nope": 1}}', "not a key scheme"),
    ],
)
def test_bad_text_names_its_origin(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        KeyScheme.from_json(text, "node n1's description")
    assert str(caught.value).startswith("node n1's description: ")
