"""What a UCX get receives is checked against the checksums its sender announced.

A real ``kvstore serve`` with a UCX listener sends the payloads; its ``UcxGet`` answer carries the
xxh3-64 of each. The damaged transfer is simulated on the receiving side (the one fault that
cannot be produced with an honest server): the test flips one announced checksum in the answer
before the receiver sees it, which is exactly what a short or corrupted message looks like to it.
The peer link (what a node uses to read another node's blocks) must then raise before anything is
installed, and give the landing pages back; the client must fall back to gRPC and still return
the right bytes. What an honest transfer brings the link comes sealed: each payload with a header
whose MAC verifies under the sender's integrity secret. A signed link takes nothing from a holder
that answers without proving it belongs to the cluster.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import xxhash
from harness.ucx_servers import NAMESPACE, NO_SHM, UCX, kv_client, ucx_address

from kvstore.block import Keyring, verify_sealed
from kvstore.node.peer_auth import PeerAuthError, PeerSigner, peer_keyring
from kvstore.node.peer_blocks import SealedBlock
from kvstore.node.peer_ucx import UcxPeerLink
from kvstore.protocol.messages import namespace_bytes
from kvstore.protocol.ucx import (
    UcxTransportError,
    payload_checksum,
    payload_checksums,
    verify_payloads,
)
from kvstore.protocol.ucx_wire import shared_loop as _shared_loop

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

SIZES = [4096, 1024**2 + 3, 3 * 1024**2]
SECRET = "ucx-checksums-test-secret"


@pytest.fixture(scope="module")
def data_plane() -> str:
    """One pass: every client here names its data plane itself (see test_ucx.py)."""
    return "ucx"


class _FlipChecksum:
    """A control stub whose ``UcxGet`` answers arrive with the first announced checksum altered."""

    def __init__(self, stub: Any, *, aio: bool) -> None:
        self._stub = stub
        self._aio = aio

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def _flip(self, response: Any) -> Any:
        response.checksums[0] ^= 1
        return response

    def UcxGet(self, request: Any, **kwargs: Any) -> Any:
        if not self._aio:
            return self._flip(self._stub.UcxGet(request, **kwargs))

        async def call() -> Any:
            return self._flip(await self._stub.UcxGet(request, **kwargs))

        return call()


class _Landing:
    """Landing pages of a reading node, reduced to what the link does with them."""

    def __init__(self) -> None:
        self.abandoned: list[bytes] = []

    async def buffers(self, keys: list[bytes], lengths: list[int]) -> list[Any]:
        return [bytearray(length) for length in lengths]

    def abandon(self, keys: list[bytes]) -> None:
        self.abandoned.extend(keys)


def _stored(server: ServerProcess) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(11)
    keys = [os.urandom(16) for _ in SIZES]
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in SIZES]
    with kv_client(server, "grpc") as client:
        assert client.put(keys, values).stored == len(keys)
    return keys, values


def _peer_get(link: UcxPeerLink, keys: list[bytes], landing: _Landing | None = None) -> Any:
    """Run the link's get on the process's one ucxx event loop, as a node's loop would; the
    payloads, each checked against its sealed header as the reading node does."""
    namespace = namespace_bytes(NAMESPACE)
    coroutine = link.get(keys, namespace, 10.0, landing)  # type: ignore[arg-type]
    blocks: list[SealedBlock | None] = _shared_loop().run(coroutine, 15.0)
    ring = Keyring([SECRET.encode()])
    for key, block in zip(keys, blocks, strict=True):
        if block is not None:
            verify_sealed(key, namespace, block.header, block.payload, ring)
    return [None if block is None else bytes(block.payload) for block in blocks]


def test_checksums_name_each_sent_payload_and_catch_short_or_damaged_ones() -> None:
    payloads = [(0, b"abc"), (2, bytearray(b"block two"))]
    checksums = payload_checksums(payloads, 3)
    assert checksums == [
        xxhash.xxh3_64_intdigest(b"abc"),
        0,
        xxhash.xxh3_64_intdigest(b"block two"),
    ]
    verify_payloads({0: b"abc", 2: b"block two"}, checksums)
    with pytest.raises(UcxTransportError, match="payload 2 does not match"):
        verify_payloads({2: b"block tw\x00"}, checksums)  # what a short message leaves behind
    with pytest.raises(UcxTransportError, match="payload 0"):
        verify_payloads({0: b"abc"}, [])  # an answer without checksums is not trusted
    assert payload_checksum(memoryview(b"abc")) == checksums[0]


def test_a_peer_read_checks_what_arrived_before_anything_is_installed(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(*NO_SHM, *UCX, env={"KVSTORE_INTEGRITY_SECRETS": SECRET})
    keys, values = _stored(server)
    address = ucx_address(server)

    async def open_link() -> UcxPeerLink:  # its aio channel belongs to the ucxx loop
        return UcxPeerLink(server.target, address, None)

    link = _shared_loop().run(open_link(), 10.0)
    try:
        assert _peer_get(link, keys) == values  # an honest transfer passes its own checks

        link._stub = _FlipChecksum(link._stub, aio=True)
        landing = _Landing()
        with pytest.raises(UcxTransportError, match="does not match the checksum"):
            _peer_get(link, keys, landing)
        assert sorted(landing.abandoned) == sorted(keys)  # none of its pages may be installed

        link._stub = link._stub._stub
        assert _peer_get(link, keys) == values  # the link reconnects and reads again
    finally:
        _shared_loop().run(link.aclose(), 10.0)


def test_a_client_falls_back_to_grpc_when_a_ucx_payload_fails_its_check(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(*NO_SHM, *UCX)
    keys, values = _stored(server)
    with kv_client(server, "ucx") as client:
        assert client.get(keys) == values
        ucx = client._ucx
        assert ucx is not None and ucx.counters["fallbacks"] == 0
        # The answer's checksums are changed on their way: over gRPC, where a wrapper can (over
        # UCX the answer is MAC'd, and a changed one is refused before its checksums are read).
        ucx._ctl.over_ucx = False
        ucx._ctl._stub = _FlipChecksum(ucx._ctl._stub, aio=False)
        buffers = [np.zeros(size, dtype=np.uint8) for size in SIZES]
        assert client.get_into(keys, buffers) == [True] * len(keys)
        assert [b.tobytes() for b in buffers] == values  # refilled over gRPC
        assert ucx.counters["fallbacks"] == 1
        assert "does not match the checksum" in ucx.last_error


def test_a_ucx_peer_read_takes_nothing_from_a_holder_that_does_not_prove_itself(
    server_factory: ServerFactory,
) -> None:
    """A server in no cluster index ignores the authenticator and sends no proof (as a rogue
    would): the signed link raises before it asks for a single buffer, and drops the endpoint
    (whatever was sent is never received)."""
    server = server_factory(*NO_SHM, *UCX, env={"KVSTORE_INTEGRITY_SECRETS": SECRET})
    keys, _ = _stored(server)
    address = ucx_address(server)
    signer = PeerSigner(peer_keyring(Keyring([SECRET.encode()])), "", "tests")

    async def open_link() -> UcxPeerLink:
        return UcxPeerLink(server.target, address, signer)

    link = _shared_loop().run(open_link(), 10.0)
    landing = _Landing()
    asked: list[int] = []

    async def buffers(keys: list[bytes], lengths: list[int]) -> list[Any]:
        asked.extend(lengths)
        return [bytearray(length) for length in lengths]

    landing.buffers = buffers  # type: ignore[method-assign]
    try:
        with pytest.raises(PeerAuthError, match="no proof"):
            _peer_get(link, keys, landing)
        assert asked == [] and landing.abandoned == []
        assert link._endpoints == []
    finally:
        _shared_loop().run(link.aclose(), 10.0)


def test_given_the_keyring_a_peer_read_checks_macs_and_reads_checksums_only_on_failure(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(*NO_SHM, *UCX, env={"KVSTORE_INTEGRITY_SECRETS": SECRET})
    keys, values = _stored(server)
    namespace = namespace_bytes(NAMESPACE)

    async def open_link() -> UcxPeerLink:
        return UcxPeerLink(server.target, ucx_address(server), None)

    def read(ring: Keyring, landing: _Landing | None = None) -> list[SealedBlock | None]:
        coroutine = link.get(keys, namespace, 10.0, landing, keyring=ring)  # type: ignore[arg-type]
        blocks: list[SealedBlock | None] = _shared_loop().run(coroutine, 15.0)
        return blocks

    link = _shared_loop().run(open_link(), 10.0)
    right, wrong = Keyring([SECRET.encode()]), Keyring([b"another cluster"])
    try:
        blocks = read(right)
        assert [b is not None and b.verified for b in blocks] == [True] * len(keys)
        assert [bytes(b.payload) for b in blocks if b is not None] == values
        # Under another secret the MACs fail, the transfer was whole: refused, not a transport
        # failure (the peer source marks the holder suspect).
        assert [b is not None and b.verified for b in read(wrong)] == [False] * len(keys)

        link._stub = _FlipChecksum(link._stub, aio=True)
        # A block whose MAC holds arrived whole, whatever the checksum says.
        assert [b is not None and b.verified for b in read(right)] == [True] * len(keys)
        # A MAC that fails and a checksum that does not match: a damaged transfer.
        landing = _Landing()
        with pytest.raises(UcxTransportError, match="does not match the checksum"):
            read(wrong, landing)
        assert sorted(landing.abandoned) == sorted(keys)
    finally:
        _shared_loop().run(link.aclose(), 10.0)


def test_a_peer_read_over_several_lanes_lands_every_block_whole(
    server_factory: ServerFactory,
) -> None:
    """A link with three lanes (``ucx.lanes``): the holder's plan spreads over them, into one
    buffer for the stream without a landing and into the landing's buffers with one."""
    server = server_factory(*NO_SHM, *UCX, env={"KVSTORE_INTEGRITY_SECRETS": SECRET})
    keys, values = _stored(server)
    address = ucx_address(server)

    async def open_link() -> UcxPeerLink:
        return UcxPeerLink(server.target, address, None, lanes=3)

    link = _shared_loop().run(open_link(), 10.0)
    try:
        assert _peer_get(link, keys) == values
        assert len(link._endpoints) == 3
        landing = _Landing()
        assert _peer_get(link, [*keys, os.urandom(16)], landing) == [*values, None]
        assert landing.abandoned == []
        # A lane that died between reads: the link opens its lanes again before the next one.
        _shared_loop().run(_abort(link._endpoints[1]), 5.0)
        assert _peer_get(link, keys) == values
    finally:
        _shared_loop().run(link.aclose(), 10.0)


async def _abort(endpoint: Any) -> None:
    endpoint.abort()
