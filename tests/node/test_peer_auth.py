"""Node authentication's pieces (:mod:`kvstore.node.peer_auth`, signed node descriptions in
:mod:`kvstore.node.membership`): what verifies, what each changed field breaks, freshness and
the replay cache's bound. The processes using them: tests/integration/test_node_auth.py."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.block import Keyring
from kvstore.cluster.records import NodeInfo, RecordError, record_keyring
from kvstore.node.peer_auth import (
    PROOF_METADATA,
    PeerAuthError,
    PeerCall,
    PeerSigner,
    ReplayGuard,
    answer_proof,
    peer_keyring,
    request_digest,
    sign_call,
    verify_call,
)

CLUSTER = Keyring([b"the cluster's secret"])
ROGUE = Keyring([b"another secret"])
KEYS = [bytes([i]) * 16 for i in range(3)]
NS = bytes(16)


def ring(keyring: Keyring = CLUSTER, tenant: str = "a") -> Keyring:
    return peer_keyring(keyring.for_tenant(tenant))


def signed(**changes: object) -> tuple[PeerCall, bytes]:
    digest = request_digest(NS, KEYS)
    call = sign_call(ring(), "Get", "a", "reader", "holder", 7, digest)
    return call, digest


def test_an_authenticator_verifies_for_exactly_its_request_holder_and_tenant() -> None:
    call, digest = signed()
    parsed = PeerCall.parse(call.metadata())
    assert parsed == call
    verify_call(ring(), parsed, "Get", "holder", 7, digest)
    wrong = [
        (ring(), "UcxGet", "holder", 7, digest),  # another method
        (ring(), "Get", "other", 7, digest),  # relayed to another node
        (ring(), "Get", "holder", 8, digest),  # the holder restarted since
        (ring(), "Get", "holder", 7, request_digest(NS, KEYS[:2])),  # other keys
        (ring(), "Get", "holder", 7, request_digest(bytes([1]) * 16, KEYS)),  # namespace
        (ring(tenant="b"), "Get", "holder", 7, digest),  # another tenant's key
        (ring(ROGUE), "Get", "holder", 7, digest),  # another secret
    ]
    for args in wrong:
        with pytest.raises(PeerAuthError):
            verify_call(args[0], parsed, *args[1:])  # type: ignore[arg-type]
    for field, value in [("tenant", "b"), ("caller", "x"), ("time_ms", 1), ("nonce", bytes(16))]:
        altered = dataclasses.replace(parsed, **{field: value})  # type: ignore[arg-type]
        with pytest.raises(PeerAuthError, match="does not verify"):
            verify_call(ring(), altered, "Get", "holder", 7, digest)


def test_a_rotated_ring_still_accepts_the_old_secret() -> None:
    call, digest = signed()
    rotated = Keyring([b"the new secret", b"the cluster's secret"])
    verify_call(ring(rotated), call, "Get", "holder", 7, digest)


@pytest.mark.parametrize(
    "value",
    ["", "v2 Get", "v1 Get zz 00 00 1 1 00 00", "x" * 5000, "v1 Get 61 72 68 1 1 0011 ab"],
)
def test_malformed_authenticators_are_refused_before_any_mac(value: str) -> None:
    with pytest.raises(PeerAuthError):
        PeerCall.parse(value)


def test_the_holder_proof_verifies_only_from_a_key_holder() -> None:
    call, _ = signed()
    signer = PeerSigner(ring(), "a", "reader")
    signer.check(call, [(PROOF_METADATA, answer_proof(ring(), call))])
    for metadata in (
        [],
        [(PROOF_METADATA, answer_proof(ring(ROGUE), call))],
        [(PROOF_METADATA, "not hex")],
        [(PROOF_METADATA, answer_proof(ring(), signed()[0]))],  # another call's proof
    ):
        with pytest.raises(PeerAuthError):
            signer.check(call, metadata)


def test_replays_and_stale_authenticators_are_refused() -> None:
    guard = ReplayGuard(window_s=30)
    call, _ = signed()
    now = call.time_ms / 1000
    guard.admit(call, now)
    with pytest.raises(PeerAuthError, match="used before"):
        guard.admit(call, now + 1)
    with pytest.raises(PeerAuthError, match="clock"):
        guard.admit(signed()[0], now + 31)
    with pytest.raises(PeerAuthError, match="clock"):
        guard.admit(signed()[0], now - 31)


def test_the_replay_cache_is_bounded_and_never_lets_a_forgotten_one_back() -> None:
    guard = ReplayGuard(window_s=30, entries=4)
    calls = [dataclasses.replace(signed()[0], time_ms=1_000_000 + i) for i in range(6)]
    for call in calls:
        guard.admit(call, 1_000.0)
    assert len(guard) == 4
    assert guard.floor == 1_000_001  # the two oldest were forgotten
    for call in calls:  # every one refused: remembered, or not newer than the floor
        with pytest.raises(PeerAuthError, match="used before"):
            guard.admit(call, 1_000.0)
    guard.admit(dataclasses.replace(signed()[0], time_ms=1_000_010), 1_000.0)
    # Past the window, entries go and the cache empties itself.
    guard.admit(dataclasses.replace(signed()[0], time_ms=1_100_000), 1_100.0)
    assert len(guard) == 1


def test_node_descriptions_verify_only_signed_unchanged_and_unexpired() -> None:
    info = NodeInfo("one", 3, "10.0.0.1:50051", "10.0.0.1:13337", {"dram": 1 << 30})
    records = record_keyring(CLUSTER)
    fields = info.signed(records, expires_ms=2_000_000)
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    got = NodeInfo.verified("one", raw, records, now=1_000.0)
    assert (got.grpc, got.ucx, got.epoch, got.expires_ms) == (info.grpc, info.ucx, 3, 2_000_000)
    refused = {
        "unsigned": {k.encode(): v.encode() for k, v in info.fields().items()},
        "wrong secret": {
            k.encode(): v.encode() for k, v in info.signed(record_keyring(ROGUE), 2_000_000).items()
        },
        "address changed": {**raw, b"grpc": b"10.6.6.6:50051"},
        "ucx changed": {**raw, b"ucx": b"10.6.6.6:1"},
        "epoch changed": {**raw, b"epoch": b"4"},
        "expiry pushed": {**raw, b"expires_ms": b"9000000"},
        "garbage": {**raw, b"capacity": b"{not json"},
    }
    for why, record in refused.items():
        with pytest.raises(RecordError):
            NodeInfo.verified("one", record, records, now=1_000.0)
        assert why
    with pytest.raises(RecordError):  # copied under another node's id
        NodeInfo.verified("rogue", raw, records, now=1_000.0)
    with pytest.raises(RecordError, match="expired"):
        NodeInfo.verified("one", raw, records, now=2_001.0)


def test_derived_keys_are_apart_from_the_block_keys_and_each_other() -> None:
    message = b"one message"
    rings = [CLUSTER, CLUSTER.derive(b"peer request"), CLUSTER.derive(b"node record")]
    for signer in rings:
        mac = signer.sign(message, ())
        assert [ring.verify(message, (), mac) for ring in rings].count(True) == 1
    assert peer_keyring(CLUSTER).verify(message, (), rings[1].sign(message, ()))


def test_an_authenticator_of_a_later_release_is_refused_for_what_it_is() -> None:
    from kvstore.node.peer_auth import PeerAuthError, PeerCall

    with pytest.raises(PeerAuthError, match="v2 authenticator, of a later release"):
        PeerCall.parse("v2 Get 61 62 63 1 2 00 00 extra")
    with pytest.raises(PeerAuthError, match="not a v1 authenticator"):
        PeerCall.parse("x1 Get")
