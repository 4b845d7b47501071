"""UCX lanes and message plans against a real ``kvstore serve --ucx-listen`` over loopback.

A client with several lanes spreads a batch's messages over them; blocks lying next to each
other in both sides' memory move as one message. Faults are real: a lane's UCX endpoint is
aborted while its messages are in flight (scheduled on the UCX loop right after the transfer's
operations are posted), and the batch must then complete over the other lanes or fall back,
never hand back wrong bytes. Needs ``ucxx`` (see :mod:`harness.ucx_servers`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from harness.ucx_servers import NAMESPACE, UCX, keys_of, ucx_address, ucx_client, values_of
from harness.ucx_servers import address as address  # fixtures, shared
from harness.ucx_servers import kv as kv
from harness.ucx_servers import ucx_server as ucx_server

import kvstore.client.ucx_lanes as client_ucx
from kvstore import KVStoreClient
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.client.ucx import UcxDataClient
from kvstore.errors import InvalidRequestError
from kvstore.protocol.messages import namespace_bytes

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

BLOCK = 256 * 1024


@pytest.fixture(scope="module")
def data_plane() -> str:
    """One pass: every client here names its data plane itself (see test_ucx.py)."""
    return "ucx"


@pytest.fixture(params=[False, True], ids=["grpc-control", "ucx-control"])
def lanes3(
    kv: KVStoreClient, address: str, request: pytest.FixtureRequest
) -> Iterator[UcxDataClient]:
    """Three lanes; control calls over gRPC, or as control messages over the first lane."""
    # Generous: a lane fault costs a second transfer, on 2 cores at load 10 or more.
    client = ucx_client(kv, address, lanes=3, timeout=30.0, ucx_control=request.param)
    yield client
    client.close()
    if request.param:  # every control call of the test went over the lanes themselves
        assert client.counters["control_grpc"] == 0, client.counters


class _LaneKiller:
    """Aborts lane ``lane`` of the next ``times`` transfers right after their operations are
    posted (the real endpoint, aborted on the UCX loop: the peer sees the connection die)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, lane: int, times: int) -> None:
        self.lane, self.left, self.fired = lane, times, 0
        self._real = client_ucx.move_messages
        monkeypatch.setattr(client_ucx, "move_messages", self._move)

    async def _move(self, op: Any, lanes: Any, *args: Any) -> Any:
        if self.left > 0 and len(lanes) > self.lane:
            self.left -= 1
            self.fired += 1
            asyncio.get_running_loop().call_soon(lanes[self.lane].abort)
        return await self._real(op, lanes, *args)


def test_a_batch_spreads_over_the_lanes_and_round_trips(lanes3: UcxDataClient) -> None:
    keys = keys_of(12)
    values = values_of([BLOCK * 4] * 12, seed=5)  # 1 MiB each: 12 messages or more
    result = lanes3.put(keys, values)
    assert result is not None and result.stored == 12, lanes3.last_error
    assert len(lanes3.lanes.live()) == 3
    buffers = [np.zeros(BLOCK * 4, np.uint8) for _ in keys]
    assert lanes3.get_into(keys, buffers) == [True] * 12
    assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
    assert lanes3.get(keys) == [v.tobytes() for v in values]
    assert lanes3.counters["fallbacks"] == 0 and lanes3.counters["connects"] == 3


def test_blocks_next_to_each_other_move_as_one_message(lanes3: UcxDataClient) -> None:
    keys = keys_of(8)
    source = np.random.default_rng(6).integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    before = lanes3.counters["messages"]
    assert lanes3.put(keys, [source[i * BLOCK : (i + 1) * BLOCK] for i in range(8)]) is not None
    assert lanes3.counters["messages"] - before == 1  # one 2 MiB message for eight blocks
    target = np.zeros(8 * BLOCK, np.uint8)
    before = lanes3.counters["messages"]
    views = [target[i * BLOCK : (i + 1) * BLOCK] for i in range(8)]
    assert lanes3.get_into(keys, views) == [True] * 8
    assert np.array_equal(source, target)
    # The server's pages of one fresh put lie in order: fewer messages than blocks.
    assert lanes3.counters["messages"] - before < 8
    # Buffers apart in memory: one message (at least) per block, bytes still exact.
    apart = [np.zeros(BLOCK, np.uint8) for _ in range(8)]
    before = lanes3.counters["messages"]
    assert lanes3.get_into(keys, apart) == [True] * 8
    assert lanes3.counters["messages"] - before >= 8
    assert np.array_equal(np.concatenate(apart), source)


@pytest.mark.parametrize("post_early", [True, False], ids=["posted-plan", "server-plan"])
def test_a_lane_dying_mid_get_costs_a_retry_not_bytes(
    lanes3: UcxDataClient, monkeypatch: pytest.MonkeyPatch, post_early: bool
) -> None:
    """Posted plan: the lane dies with its receives posted, before or while the server sends
    (the server may already have forgotten it). Server plan: it dies while receiving."""
    lanes3.post_early = post_early
    keys = keys_of(16)
    values = values_of([BLOCK * 4] * 16, seed=7)
    assert lanes3.put(keys, values) is not None
    killer = _LaneKiller(monkeypatch, lane=1, times=1)
    buffers = [np.zeros(BLOCK * 4, np.uint8) for _ in keys]
    assert lanes3.get_into(keys, buffers) == [True] * 16, lanes3.last_error
    assert killer.fired == 1
    assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
    assert lanes3.counters["retries"] == 1
    assert post_early or lanes3.counters["lane_failures"] >= 1
    assert lanes3.counters["fallbacks"] == 0 and lanes3.usable
    assert len(lanes3.lanes.live()) == 3  # the dead lane was replaced


def test_a_lane_dying_mid_put_sends_the_batch_again(
    lanes3: UcxDataClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = keys_of(16)
    values = values_of([BLOCK * 4] * 16, seed=8)
    killer = _LaneKiller(monkeypatch, lane=2, times=1)
    result = lanes3.put(keys, values)
    assert result is not None and result.stored == 16, lanes3.last_error
    assert killer.fired == 1 and lanes3.counters["retries"] == 1
    assert lanes3.get(keys) == [v.tobytes() for v in values]


def test_lanes_dying_on_every_try_fall_back_to_grpc_with_the_right_bytes(
    ucx_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_UCX_LANES", "2")
    keys = keys_of(8)
    values = values_of([BLOCK * 4] * 8, seed=9)
    with KVStoreClient(ucx_server.target, namespace=NAMESPACE, timeout=20, data_plane="ucx") as kv:
        kv.put(keys, values)
        ucx = kv._ucx
        assert ucx is not None and ucx.lanes.size == 2
        _LaneKiller(monkeypatch, lane=0, times=10)
        buffers = [np.zeros(BLOCK * 4, np.uint8) for _ in keys]
        assert kv.get_into(keys, buffers) == [True] * 8
        assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
        assert ucx.counters["fallbacks"] == 1 and "lane" in ucx.last_error


def test_the_server_bounds_the_lanes_of_a_transfer(
    kv: KVStoreClient, lanes3: UcxDataClient
) -> None:
    assert lanes3.put(keys_of(1), [b"x" * 4096]) is not None
    lane = lanes3.lanes.live()[0]
    stub = ucx_pb_grpc.UcxTransferStub(kv._transport.channel)
    for lanes, why in (([b"y" * 16] * 8, "ucx.max_lanes"), ([lane.client_id], "twice")):
        request = ucx_pb.UcxGetRequest(
            namespace=namespace_bytes(NAMESPACE),
            keys=keys_of(1),
            client_id=lane.client_id,
            lanes=lanes,
            transfer_id=10**6,
        )
        with pytest.raises(grpc.RpcError) as failure:
            stub.UcxGet(request, timeout=10)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in (failure.value.details() or "")


def test_a_server_with_one_lane_allowed_refuses_two(server_factory: ServerFactory) -> None:
    server = server_factory(*UCX, env={"KVSTORE_UCX_MAX_LANES": "1"})
    with KVStoreClient(server.target, namespace=NAMESPACE, timeout=10, data_plane="grpc") as kv:
        client = UcxDataClient(
            kv._transport.channel, ucx_address(server), namespace_bytes(NAMESPACE), lanes=2
        )
        try:
            with pytest.raises(InvalidRequestError, match=r"ucx\.max_lanes"):
                client.put(keys_of(1), [b"z" * 100])
        finally:
            client.close()


def test_a_posted_plan_never_writes_a_miss_and_asks_again_for_its_neighbours(
    lanes3: UcxDataClient,
) -> None:
    """get_into posts its receives before the control call, for one message over buffers that
    follow each other; a miss inside it makes the server send that message empty (nothing is
    written), and the client asks again for the blocks found, without a plan."""
    keys = keys_of(3)
    values = values_of([BLOCK] * 3, seed=12)
    assert lanes3.put([keys[0], keys[2]], [values[0], values[2]]) is not None
    target = np.full(3 * BLOCK, 7, np.uint8)
    views = [target[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    before = lanes3.counters["retries"]
    assert lanes3.get_into(keys, views) == [True, False, True]
    assert np.array_equal(views[0], values[0]) and np.array_equal(views[2], values[2])
    assert (views[1] == 7).all()  # the miss's buffer is untouched
    assert lanes3.counters["retries"] == before + 1
    # All found: one posted message, no second round.
    assert lanes3.put([keys[1]], [values[1]]) is not None
    before = lanes3.counters["retries"], lanes3.counters["transfers"]
    assert lanes3.get_into(keys, views) == [True] * 3
    assert np.array_equal(target, np.concatenate(values))
    assert (lanes3.counters["retries"], lanes3.counters["transfers"]) == (before[0], before[1] + 1)
