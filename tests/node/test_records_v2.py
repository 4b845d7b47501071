"""Node descriptions v2 (:mod:`kvstore.cluster.records`): the key schemes a node serves ride
under the MAC; v1 descriptions (no schemes) still verify, and a v2 one never passes as v1."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.block import Keyring
from kvstore.cluster.records import _RECORD_LABEL_V1, NodeInfo, RecordError, record_keyring
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace

RING = record_keyring(Keyring([b"the cluster's secret"]))
SCHEME = KeyScheme.with_secret(Namespace(model="m"), 128, env={"KVSTORE_HASH_SECRET": "s"})
INFO = NodeInfo("one", 3, "10.0.0.1:50051", "", {"dram": 1 << 30}, keys=(SCHEME.to_json(),))


def raw(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_schemes_round_trip_under_the_mac() -> None:
    record = raw(INFO.signed(RING, expires_ms=2_000_000))
    got = NodeInfo.verified("one", record, RING, now=1_000.0)
    assert got.keys == (SCHEME.to_json(),)
    assert KeyScheme.from_json(got.keys[0], "test") == SCHEME


@pytest.mark.parametrize(
    "keys",
    [
        # another chunk size: the router would name every chunk differently
        [dataclasses.replace(SCHEME, chunk_size=256).to_json()],
        [],  # schemes dropped
        [SCHEME.to_json(), SCHEME.to_json()],  # one added
    ],
)
def test_a_changed_keys_field_fails_the_mac(keys: list[str]) -> None:
    import json

    record = raw(INFO.signed(RING, expires_ms=2_000_000))
    record[b"keys"] = json.dumps(keys).encode()
    with pytest.raises(RecordError, match="MAC does not verify"):
        NodeInfo.verified("one", record, RING, now=1_000.0)


def test_dropping_the_keys_field_does_not_pass_as_v1() -> None:
    record = raw(INFO.signed(RING, expires_ms=2_000_000))
    del record[b"keys"]
    with pytest.raises(RecordError, match="MAC does not verify"):
        NodeInfo.verified("one", record, RING, now=1_000.0)


def test_v1_descriptions_still_verify_without_schemes() -> None:
    v1 = dataclasses.replace(INFO, keys=None)
    record = raw(v1.signed(RING, expires_ms=2_000_000))
    assert b"keys" not in record
    got = NodeInfo.verified("one", record, RING, now=1_000.0)
    assert got.keys is None and got.grpc == INFO.grpc
    assert v1._message().startswith(_RECORD_LABEL_V1)


def test_a_v1_reader_refuses_a_v2_description() -> None:
    """What a reader of before v2 computes: the v1 message over the v1 fields, which a v2
    description's MAC does not cover."""
    record = raw(INFO.signed(RING, expires_ms=2_000_000))
    as_v1 = dataclasses.replace(NodeInfo.parse("one", record), keys=None)
    assert not RING.verify(as_v1._message(), (), bytes.fromhex(record[b"mac"].decode()))


def test_malformed_keys_are_refused() -> None:
    record = raw(INFO.signed(RING, expires_ms=2_000_000))
    record[b"keys"] = b'{"not": "a list"}'
    with pytest.raises(RecordError, match="malformed"):
        NodeInfo.verified("one", record, RING, now=1_000.0)
