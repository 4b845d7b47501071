"""Control messages over UCX (issue 40): a get's or put's request and answer as two tagged
messages on the client's own endpoint, authenticated by the key an authenticated ``UcxBind``
gave that endpoint, with the gRPC calls as the fallback.

Real ``kvstore serve`` processes with ``--ucx-listen``; forged messages are sent over a real
client's endpoint, framed by :mod:`kvstore.protocol.ucx_control`. The previous release (which
has no ``UcxBind``) is built from this repository's history, as the mixed-version test does.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from harness.previous_release import previous_release_checkout
from harness.ucx_guard import require_ucx

from kvstore import KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.protocol import ucx_control as ctl
from kvstore.protocol.messages import namespace_bytes
from kvstore.protocol.ucx_wire import abort_endpoint

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

require_ucx()

from kvstore.client.ucx import UcxDataClient  # noqa: E402
from kvstore.client.ucx_lanes import Lane  # noqa: E402

NAMESPACE = Namespace(model="ucx-control-test", num_layers=2, num_kv_heads=2, head_size=64)
UCX = ("--ucx-listen", "127.0.0.1:0", "--allow-unauthenticated")
#: Transfer ids of the forged messages: far from the client's own (which count from 1).
FORGED_IDS = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def data_plane() -> str:
    """One pass: every client here names its data plane itself (see test_ucx.py)."""
    return "ucx"


@pytest.fixture(scope="module")
def ucx_server(module_server_factory: ServerFactory) -> Iterator[ServerProcess]:
    server = module_server_factory(*UCX, dram_capacity="256MiB", nvme_capacity="256MiB")
    yield server
    if server.running:
        server.stop()


def ucx_address(server: ServerProcess) -> str:
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=10.0)
    return str(response.ucx_address)


@pytest.fixture
def kv(ucx_server: ServerProcess) -> Iterator[KVStoreClient]:
    with KVStoreClient(ucx_server.target, namespace=NAMESPACE, data_plane="grpc") as client:
        yield client


def ucx_client(kv: KVStoreClient, server: ServerProcess, **kwargs: Any) -> UcxDataClient:
    address = ucx_address(server)
    assert address, server.stderr()
    channel = kv._transport.channel  # type: ignore[attr-defined]
    kwargs.setdefault("ucx_control", True)
    return UcxDataClient(channel, address, namespace_bytes(NAMESPACE), timeout=20.0, **kwargs)


def blocks(count: int, size: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [os.urandom(16) for _ in range(count)]
    return keys, [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def test_gets_and_puts_make_their_control_calls_over_ucx(
    kv: KVStoreClient, ucx_server: ServerProcess
) -> None:
    client = ucx_client(kv, ucx_server)
    try:
        keys, values = blocks(4, 300_000)
        assert client.put(keys, values) is not None, client.last_error
        out = [np.zeros(300_000, dtype=np.uint8) for _ in keys]
        assert client.get_into(keys, out) == [True] * 4
        assert all(np.array_equal(a, b) for a, b in zip(values, out, strict=True))
        assert client.get(keys) == [v.tobytes() for v in values]
        assert client.counters["control_ucx"] == 3 and client.counters["control_grpc"] == 0
        assert client.counters["fallbacks"] == 0
    finally:
        client.close()
    gated = ucx_client(kv, ucx_server, ucx_control=False)
    try:
        assert gated.get(keys) == [v.tobytes() for v in values]
        assert gated.counters["control_ucx"] == 0 and gated.counters["control_grpc"] == 1
    finally:
        gated.close()


def _exchange(client: UcxDataClient, lane: Lane, frame: bytes, transfer_id: int) -> ctl.Frame:
    """Send ``frame`` on ``lane``'s endpoint; the answer, decoded with the lane's key."""

    async def run() -> np.ndarray:
        answer = np.empty(64 * 1024, dtype=np.uint8)
        receiving = asyncio.ensure_future(
            lane.endpoint.recv(answer, tag=ctl.answer_tag(transfer_id))
        )
        await lane.endpoint.send(np.frombuffer(frame, dtype=np.uint8), tag=ctl.CONTROL_TAG)
        await asyncio.wait_for(receiving, 20.0)
        return answer

    answer = client._loop().run(run(), 25.0)
    assert lane.control_key is not None
    return ctl.decode(lane.control_key, answer, {ctl.ANSWER_ERROR, ctl.ANSWER_GET})


def _refusal(answer: ctl.Frame) -> tuple[grpc.StatusCode, str]:
    assert answer.kind == ctl.ANSWER_ERROR
    value, details = ctl.error_of(answer)
    return next(c for c in grpc.StatusCode if c.value[0] == value), details


def test_forged_replayed_and_misnamed_control_messages_are_refused_and_serving_goes_on(
    kv: KVStoreClient, ucx_server: ServerProcess
) -> None:
    client = ucx_client(kv, ucx_server)
    try:
        keys, values = blocks(2, 50_000, seed=1)
        assert client.put(keys, values) is not None, client.last_error
        (lane,) = client.lanes.live()
        assert lane.control_key is not None
        key = lane.control_key

        def request(transfer_id: int, client_id: bytes = lane.client_id) -> bytes:
            return ucx_pb.UcxGetRequest(
                namespace=namespace_bytes(NAMESPACE),
                keys=keys,
                client_id=client_id,
                transfer_id=transfer_id,
                receive_any=True,
            ).SerializeToString()

        def frame(transfer_id: int, body: bytes, *, under: bytes = key, seq: int = 0) -> bytes:
            if not seq:
                lane.control_seq += 1  # the client's own messages must keep rising past it
                seq = lane.control_seq
            return ctl.encode(under, ctl.REQUEST_GET, seq, transfer_id, body, timeout_ms=10_000)

        cases = [
            # Signed with another key: whoever sent it never saw the endpoint's key.
            (
                FORGED_IDS + 1,
                frame(FORGED_IDS + 1, request(FORGED_IDS + 1), under=os.urandom(32)),
                "MAC",
            ),
            # A sequence number already used: a replayed message.
            (FORGED_IDS + 2, frame(FORGED_IDS + 2, request(FORGED_IDS + 2), seq=1), "replay"),
        ]
        for transfer_id, message, why in cases:
            code, details = _refusal(_exchange(client, lane, message, transfer_id))
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
            assert details.startswith("UCX control message refused") and why in details
        # Authentic, but naming another endpoint than the one it arrived on.
        other = frame(FORGED_IDS + 3, request(FORGED_IDS + 3, client_id=os.urandom(16)))
        code, details = _refusal(_exchange(client, lane, other, FORGED_IDS + 3))
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        # Authentic, but not a request.
        junk = frame(FORGED_IDS + 4, b"\xff" * 40)
        code, details = _refusal(_exchange(client, lane, junk, FORGED_IDS + 4))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details

        # The endpoint and the server go on serving, over UCX control messages.
        assert client.get(keys) == [v.tobytes() for v in values]
        assert client.counters["fallbacks"] == 0 and client.counters["control_grpc"] == 0
        assert ucx_server.running
    finally:
        client.close()


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkout of :data:`PREVIOUS_RELEASE` (no ``UcxBind``), as a git worktree."""
    with previous_release_checkout(tmp_path_factory.mktemp("previous") / "release") as where:
        yield where


@pytest.mark.slow
def test_a_server_of_the_previous_release_gets_grpc_control_calls(
    previous_release: Path, server_factory: ServerFactory
) -> None:
    env = {"PYTHONPATH": str(previous_release), "PYTHONSAFEPATH": "1"}
    old = server_factory(*UCX, env=env)
    with KVStoreClient(old.target, namespace=NAMESPACE, data_plane="grpc") as kv:
        client = ucx_client(kv, old)
        try:
            keys, values = blocks(3, 200_000, seed=2)
            assert client.put(keys, values) is not None, client.last_error
            assert client.get(keys) == [v.tobytes() for v in values]
            # Blocks of one staging array, over 4 MiB each: this release would join and cut
            # them into other messages than the previous one receives.
            size = 5 * 1024**2 + 3
            staging = np.random.default_rng(3).integers(0, 256, 3 * size, dtype=np.uint8)
            slices = [staging[i * size : (i + 1) * size] for i in range(3)]
            big = [os.urandom(16) for _ in slices]
            assert client.put(big, slices) is not None, client.last_error
            target = np.zeros_like(staging)
            views = [target[i * size : (i + 1) * size] for i in range(3)]
            assert client.get_into(big, views) == [True] * 3
            assert np.array_equal(target, staging)
            assert client.counters["control_ucx"] == 0 and client.counters["control_grpc"] == 4
            assert client.counters["fallbacks"] == 0, client.last_error
        finally:
            client.close()
        with KVStoreClient(old.target, namespace=NAMESPACE, data_plane="grpc") as reference:
            assert reference.get(big) == [piece.tobytes() for piece in slices]


def test_a_lane_aborted_between_calls_is_replaced_and_bound_again(
    kv: KVStoreClient, ucx_server: ServerProcess
) -> None:
    client = ucx_client(kv, ucx_server)
    try:
        keys, values = blocks(3, 1024**2 + 5, seed=4)
        assert client.put(keys, values) is not None, client.last_error
        (lane,) = client.lanes.live()
        client._loop().run(abort_endpoint(lane.endpoint), 10.0)  # as a peer's failure would
        out = [np.zeros(1024**2 + 5, dtype=np.uint8) for _ in keys]
        assert client.get_into(keys, out) == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(values, out, strict=True))
        (new,) = client.lanes.live()
        assert new is not lane and new.control_key is not None
        assert new.control_key != lane.control_key
        assert client.counters["control_grpc"] == 0 and client.counters["fallbacks"] == 0
    finally:
        client.close()
