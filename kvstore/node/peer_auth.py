"""How two nodes of a cluster prove to each other that they belong to it, per request.

Anyone able to write to the index Redis can register a node, so nothing secret may ever be sent
to a node for being named there (a bearer token would be collected by the first rogue entry, in
clear without TLS). Instead every node derives, from the cluster's integrity secrets bound to a
tenant (:meth:`~kvstore.block.Keyring.for_tenant`), that tenant's *peer key*
(:func:`peer_keyring`), and:

* the **caller** sends, with each peer read (``KVStore.Get``, ``UcxTransfer.UcxGet``), an
  authenticator (:class:`PeerCall`, gRPC metadata :data:`CALL_METADATA`): a MAC under that key
  over the method, the tenant, the caller's and the holder's node ids, the holder's boot epoch,
  a digest of the request (namespace, keys and, for UCX, the endpoint and transfer the payloads
  go to), a timestamp and a random nonce. It proves the caller holds the secret and reveals
  nothing a rogue could reuse: it names one holder at one epoch (a rogue relaying it to that
  node finds it refused once the node moved; while it has not, the holder's answer is sealed for
  the caller's own request) and is accepted once, within :data:`WINDOW_S` of its timestamp.
* the **holder** checks it (:func:`verify_call`) and its freshness (:class:`ReplayGuard`:
  the time window plus a bounded cache of authenticators seen), serves from the tenant it names,
  and answers with a proof (:func:`answer_proof`, initial metadata :data:`PROOF_METADATA`): a
  MAC under the same key over the caller's authenticator. The caller checks the proof
  (:func:`check_proof`) before it reads a byte of the answer, and every block of it is verified
  against its own keyed MAC besides (:mod:`kvstore.node.peer_blocks`).

Why MACs under a derived key and not mTLS between nodes: the cluster already shares the
integrity secret (every node must, to read Redis and NVMe blocks), so keys derived from it need
no new distribution, work the same over gRPC and the UCX control call, bind each request to its
content and tenant (per-tenant peer credentials for free), and stay independent of how an operator
set TLS up for clients. The cost is one HMAC over about a hundred bytes per request and side.

Node ids, tenant names and the nonce are hex or plain ASCII in the metadata; the whole value is
at most :data:`MAX_METADATA_CHARS` and is parsed with bounds before any MAC is computed.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import Keyring
from kvstore.formats import PEER_CALL, NewerFormatError

__all__ = [
    "CALL_METADATA",
    "MAX_METADATA_CHARS",
    "PEER_METHODS",
    "PROOF_METADATA",
    "REPLAY_ENTRIES",
    "WINDOW_S",
    "PeerAuthError",
    "PeerCall",
    "PeerSigner",
    "ReplayGuard",
    "answer_proof",
    "check_proof",
    "peer_keyring",
    "request_digest",
    "sign_call",
    "verify_call",
]

#: gRPC metadata key of a caller's authenticator.
CALL_METADATA = "kvstore-peer"
#: gRPC (initial) metadata key of a holder's proof.
PROOF_METADATA = "kvstore-peer-proof"
#: The calls a node may make on another with an authenticator instead of a bearer token.
PEER_METHODS = {
    "/kvstore.v1.KVStore/Get": "Get",
    "/kvstore.v1.UcxTransfer/UcxGet": "UcxGet",
}
#: How far an authenticator's timestamp may be from the holder's clock, either way (nodes keep
#: their clocks in sync, e.g. NTP; a request takes at most ``cluster.peer_timeout_s``).
WINDOW_S = 30.0
#: Authenticators a holder remembers to refuse their replay (about 100 bytes each). Past it the
#: oldest is forgotten and everything not newer than it refused: bounded memory, no replay.
REPLAY_ENTRIES = 100_000
#: Longest metadata value accepted (node ids and tenant names are short).
MAX_METADATA_CHARS = 1024

_VERSION = "v1"
_NONCE_BYTES = 16
_PURPOSE = b"peer request"
_CALL_LABEL = b"kvstore peer call v1\x00"
_PROOF_LABEL = b"kvstore peer proof v1\x00"


class PeerAuthError(Exception):
    """An authenticator or a proof that does not hold: its message says why (no secret in it)."""


def peer_keyring(tenant_keyring: Keyring) -> Keyring:
    """The peer key of a tenant, from the keyring its blocks are signed with (rotation kept: a
    call is signed with the first secret and accepted under any)."""
    return tenant_keyring.derive(_PURPOSE)


def request_digest(namespace: bytes, keys: Sequence[bytes], extra: bytes = b"") -> bytes:
    """SHA-256 of what a peer read asks for: its namespace, its keys in order, and ``extra``
    (the UCX endpoint and transfer its payloads go to), each length-prefixed."""
    digest = hashlib.sha256()
    for part in (namespace, *keys):
        digest.update(struct.pack("<I", len(part)))
        digest.update(part)
    digest.update(struct.pack("<I", len(extra)))
    digest.update(extra)
    return digest.digest()


@dataclass(frozen=True)
class PeerCall:
    """One peer read's authenticator, as it travels in :data:`CALL_METADATA`."""

    method: str
    tenant: str
    caller: str
    holder: str
    epoch: int
    time_ms: int
    nonce: bytes
    mac: bytes

    def metadata(self) -> str:
        """The metadata value: ``v1 METHOD TENANT CALLER HOLDER EPOCH MS NONCE MAC`` (ids hex)."""
        return " ".join(
            (
                _VERSION,
                self.method,
                self.tenant.encode().hex(),
                self.caller.encode().hex(),
                self.holder.encode().hex(),
                str(self.epoch),
                str(self.time_ms),
                self.nonce.hex(),
                self.mac.hex(),
            )
        )

    @classmethod
    def parse(cls, value: str | bytes) -> PeerCall:
        """The inverse of :meth:`metadata`; :class:`PeerAuthError` for anything else."""
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if len(text) > MAX_METADATA_CHARS:
            raise PeerAuthError(f"the {CALL_METADATA} metadata is over {MAX_METADATA_CHARS} chars")
        words = text.split(" ")
        named = words[0][1:] if words[0].startswith("v") else ""
        if named.isdigit() and PEER_CALL.is_newer(int(named)):
            # Refused all the same (it cannot be checked), but said for what it is.
            newer = NewerFormatError(PEER_CALL, int(named))
            raise PeerAuthError(
                f"the {CALL_METADATA} metadata is a {words[0]} authenticator, of a later release "
                f"than this node's (which reads {_VERSION}): {newer}"
            )
        if len(words) != 9 or words[0] != _VERSION:
            raise PeerAuthError(
                f"the {CALL_METADATA} metadata is not a {_VERSION} authenticator (nodes of one "
                "cluster must run the same kvstore version)"
            )
        try:
            tenant, caller, holder = (bytes.fromhex(w).decode() for w in words[2:5])
            epoch, time_ms = int(words[5]), int(words[6])
            nonce, mac = bytes.fromhex(words[7]), bytes.fromhex(words[8])
        except ValueError as exc:
            raise PeerAuthError(f"the {CALL_METADATA} metadata is malformed ({exc})") from exc
        if len(nonce) != _NONCE_BYTES or not mac:
            raise PeerAuthError(f"the {CALL_METADATA} metadata has a bad nonce or MAC")
        return cls(words[1], tenant, caller, holder, epoch, time_ms, nonce, mac)

    def _message(self, digest: bytes) -> bytes:
        fields = (self.method, self.tenant, self.caller, self.holder)
        parts = [_CALL_LABEL]
        for field in fields:
            encoded = field.encode()
            parts.append(struct.pack("<I", len(encoded)) + encoded)
        parts.append(struct.pack("<qq", self.epoch, self.time_ms))
        parts.append(self.nonce)
        parts.append(digest)
        return b"".join(parts)


def sign_call(
    ring: Keyring,
    method: str,
    tenant: str,
    caller: str,
    holder: str,
    epoch: int,
    digest: bytes,
    now: float | None = None,
) -> PeerCall:
    """An authenticator for one read of ``holder`` (at boot ``epoch``) by ``caller``, for
    ``tenant``, of the request whose :func:`request_digest` is ``digest``; ``ring`` is the
    tenant's :func:`peer_keyring`."""
    time_ms = int((time.time() if now is None else now) * 1000)
    unsigned = PeerCall(method, tenant, caller, holder, epoch, time_ms, os.urandom(16), b"")
    mac = ring.sign(unsigned._message(digest), ())
    return PeerCall(method, tenant, caller, holder, epoch, time_ms, unsigned.nonce, mac)


def verify_call(
    ring: Keyring, call: PeerCall, method: str, holder: str, epoch: int | None, digest: bytes
) -> None:
    """Raise :class:`PeerAuthError` unless ``call`` is ``ring``'s authenticator of exactly this
    request (``digest``) to ``method`` of this ``holder`` at this boot ``epoch``."""
    if call.method != method:
        raise PeerAuthError(f"the authenticator is for {call.method}, not {method}")
    if call.holder != holder or call.epoch != epoch:
        # Names no secret: the caller read an old or forged description of this node.
        raise PeerAuthError(
            f"the authenticator names node {call.holder!r} at epoch {call.epoch}; this is node "
            f"{holder!r} at epoch {epoch}"
        )
    if not ring.verify(call._message(digest), (), call.mac):
        raise PeerAuthError(
            "the authenticator does not verify: the caller holds other integrity secrets (every "
            "node needs the same integrity.secrets), or the request was altered"
        )


def answer_proof(ring: Keyring, call: PeerCall) -> str:
    """The holder's proof, for the answer's initial metadata, that it holds ``ring`` too: a MAC
    over the caller's authenticator (hex)."""
    return ring.sign(_PROOF_LABEL + call.mac, ()).hex()


def check_proof(ring: Keyring, call: PeerCall, proof: str | bytes | None) -> None:
    """Raise :class:`PeerAuthError` unless ``proof`` is :func:`answer_proof` of ``call``."""
    if proof is None:
        raise PeerAuthError("the holder sent no proof that it belongs to the cluster")
    text = proof.decode(errors="replace") if isinstance(proof, bytes) else proof
    try:
        mac = bytes.fromhex(text[: 2 * MAX_METADATA_CHARS])
    except ValueError as exc:
        raise PeerAuthError("the holder's proof is malformed") from exc
    if not ring.verify(_PROOF_LABEL + call.mac, (), mac):
        raise PeerAuthError("the holder's proof does not verify: not a node of this cluster")


@dataclass(frozen=True)
class PeerSigner:
    """What a node reading its peers for one tenant signs with: that tenant's peer key
    (:func:`peer_keyring`), its name, and this node's id."""

    ring: Keyring
    tenant: str
    caller: str

    def sign(self, method: str, holder: str, epoch: int, digest: bytes) -> PeerCall:
        """An authenticator for ``method`` of ``holder`` at ``epoch`` (see :func:`sign_call`)."""
        return sign_call(self.ring, method, self.tenant, self.caller, holder, epoch, digest)

    def check(self, call: PeerCall, metadata: object) -> None:
        """Raise :class:`PeerAuthError` unless the answer's initial ``metadata`` (pairs, or a
        ``grpc.aio.Metadata``) carries the holder's proof for ``call``."""
        proofs = [value for key, value in _pairs(metadata) if key == PROOF_METADATA]
        check_proof(self.ring, call, proofs[0] if proofs else None)


def _pairs(metadata: object) -> list[tuple[str, str | bytes]]:
    if metadata is None:
        return []
    return [(str(key), value) for key, value in metadata]  # type: ignore[attr-defined]


class ReplayGuard:
    """Refuses an authenticator outside :data:`WINDOW_S` of this clock, or seen before.

    Remembers up to ``entries`` authenticators (by MAC) until they leave the window. When full,
    the one with the oldest timestamp is forgotten and every authenticator not newer than it is
    refused from then on (``floor``): a burst shrinks the window instead of letting a replay in.
    """

    def __init__(self, window_s: float = WINDOW_S, entries: int = REPLAY_ENTRIES) -> None:
        self.window_ms = int(window_s * 1000)
        self.entries = entries
        self._seen: set[bytes] = set()
        self._order: list[tuple[int, bytes]] = []
        #: Timestamps at or below this (ms) are refused: their authenticators may be forgotten.
        self.floor = 0

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, call: PeerCall, now: float | None = None) -> None:
        """Record ``call``; :class:`PeerAuthError` if it is stale, from the future or replayed.
        Call only for authenticators that verified (a forged one must not fill the cache)."""
        now_ms = int((time.time() if now is None else now) * 1000)
        self._expire(now_ms - self.window_ms)
        if abs(call.time_ms - now_ms) > self.window_ms:
            raise PeerAuthError(
                f"the authenticator is {abs(call.time_ms - now_ms) / 1000:.1f}s from this node's "
                f"clock (at most {self.window_ms / 1000:g}s): keep the nodes' clocks in sync"
            )
        if call.time_ms <= self.floor or call.mac in self._seen:
            raise PeerAuthError("the authenticator was used before (a replayed request)")
        if len(self._seen) >= self.entries:
            time_ms, mac = heapq.heappop(self._order)
            self._seen.discard(mac)
            self.floor = max(self.floor, time_ms)
        self._seen.add(call.mac)
        heapq.heappush(self._order, (call.time_ms, call.mac))

    def _expire(self, oldest_ms: int) -> None:
        order = self._order
        while order and order[0][0] < oldest_ms:
            _, mac = heapq.heappop(order)
            self._seen.discard(mac)
