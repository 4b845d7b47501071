"""Retention asked through a vLLM request's ``kv_transfer_params`` (no vLLM): the scheduler half
reads it, plans saves that carry it (none for ``"none"``), and the worker half stores the chunks
with it in a real ``kvstore serve``, where they outlive a flood of one-off prompts.

Stand-ins for vLLM's objects and the in-memory store come from :mod:`harness.connector_sides`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.connector_sides import (
    CHUNK,
    FakeStore,
    chunk_keys_of,
    connector_settings,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.serve import ServerProcess
from harness.vllm_scheduler import StandInManager, stand_in_output, stand_in_request

from kvstore import KVStoreClient, Retention
from kvstore.integrations.vllm.common import base_namespace, engine_shape
from kvstore.integrations.vllm.retention import request_retention
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide


def _side(store: FakeStore | None, **extra: Any) -> tuple[SchedulerSide, StandInManager]:
    side = SchedulerSide(
        connector_settings(**extra),
        stand_in_vllm_config(),
        stand_in_kv_cache_config(),
        client=store,
    )
    manager = StandInManager()
    side.bind_kv_cache_manager(manager)
    return side, manager


@pytest.fixture()
def sides() -> Iterator[list[SchedulerSide]]:
    made: list[SchedulerSide] = []
    yield made
    for side in made:
        side.shutdown()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (None, Retention()),
        ({"other": 1}, Retention()),
        ({"kvstore_retention_s": 3600}, Retention(3600)),
        ({"kvstore_retention_tiers": "fast"}, Retention(tiers="fast")),
        ({"kvstore_retention_s": 300, "kvstore_retention_tiers": "fast"}, Retention(300, "fast")),
        ({"kvstore_retention_tiers": "none"}, Retention(tiers="none")),
    ],
)
def test_kv_transfer_params_give_the_retention(params: Any, expected: Retention) -> None:
    assert request_retention(params) == expected


@pytest.mark.parametrize(
    "params",
    [
        {"kvstore_retention_tiers": "nope"},
        {"kvstore_retention_s": -1},
        {"kvstore_retention_s": "3600"},
        {"kvstore_retention_s": True},
    ],
)
def test_a_bad_value_is_logged_and_stores_nothing(
    params: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "kvstore.integrations.vllm.retention"):
        assert request_retention(params, "r1") == Retention(tiers="none")
    assert "request r1" in caplog.text and "not storing its chunks" in caplog.text
    assert "'all', 'fast', 'none'" in caplog.text


def test_saves_carry_the_retention_and_none_plans_no_save(sides: list[SchedulerSide]) -> None:
    side, manager = _side(FakeStore())
    sides.append(side)
    tokens = list(range(3 * CHUNK + 5))
    kept = stand_in_request("kept", tokens, kv_transfer_params={"kvstore_retention_s": 600})
    skipped = stand_in_request("skip", [t + 1 for t in tokens], kv_transfer_params=dict(NONE))
    for request in (kept, skipped):
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        manager.blocks[request.request_id] = list(range(7))
    plan = side.build_connector_meta(
        stand_in_output([("kept", 0, len(tokens)), ("skip", 0, len(tokens))])
    )
    assert [(s.req_id, s.retention) for s in plan.saves] == [("kept", Retention(600))]
    assert plan.saves[0].keys == chunk_keys_of(side, kept)
    assert side.request_finished(skipped, manager.blocks["skip"]) == (False, None)


def test_a_retained_request_saves_again_what_a_plain_one_just_saved(
    sides: list[SchedulerSide],
) -> None:
    side, manager = _side(FakeStore())
    sides.append(side)
    tokens = list(range(2 * CHUNK + 5))
    plain = stand_in_request("plain", tokens)
    side.get_num_new_matched_tokens(plain, 0)
    manager.blocks["plain"] = list(range(5))
    first = side.build_connector_meta(stand_in_output([("plain", 0, len(tokens))]))
    assert len(first.saves) == 1 and first.saves[0].retention == Retention()
    again = stand_in_request("again", tokens)  # plain: deduplicated against the recent save
    pinned = stand_in_request("pinned", tokens, kv_transfer_params={"kvstore_retention_s": 60})
    for request in (again, pinned):
        side.get_num_new_matched_tokens(request, 0)
        manager.blocks[request.request_id] = list(range(5))
    plan = side.build_connector_meta(
        stand_in_output([("again", 0, len(tokens)), ("pinned", 0, len(tokens))])
    )
    assert [(s.req_id, s.retention) for s in plan.saves] == [("pinned", Retention(60))]


NONE = {"kvstore_retention_tiers": "none"}


def test_a_retained_prompt_saved_by_the_connector_survives_a_flood(
    tmp_path: Path, sides: list[SchedulerSide]
) -> None:
    """Done-when of issue 31, through the connector's halves and a real ``kvstore serve``: a
    prompt saved with ``kvstore_retention_s`` is still a hit after a flood that evicts a plain
    one; a prompt saved with ``"none"`` never is."""
    (tmp_path / "tmp").mkdir()
    args = ["--listen", "127.0.0.1:0", "--nvme-path", str(tmp_path / "nvme")]
    flags = [*args, "--dram-capacity", "4MiB", "--nvme-capacity", "4MiB"]
    server = ServerProcess(
        tmp_path / "serve", flags, tmpdir=tmp_path / "tmp", settings={"keys.chunk_size": CHUNK}
    ).start()
    try:
        settings = {"target": server.target}
        side, manager = _side(None, **settings)
        sides.append(side)
        worker = WorkerSide(
            connector_settings(**settings), stand_in_vllm_config(), stand_in_kv_cache_config()
        )
        try:
            worker.register_kv_caches(random_caches(1))
            prompts = {
                "plain": (list(range(3 * CHUNK + 5)), None),
                "pinned": (list(range(1000, 1000 + 3 * CHUNK + 5)), {"kvstore_retention_s": 600}),
                "none": (list(range(2000, 2000 + 3 * CHUNK + 5)), NONE),
            }
            requests = {}
            for name, (tokens, params) in prompts.items():
                request = stand_in_request(name, tokens, kv_transfer_params=params)
                requests[name] = request
                side.get_num_new_matched_tokens(request, 0)
                manager.blocks[name] = list(range(7))
            plan = side.build_connector_meta(
                stand_in_output([(name, 0, len(tokens)) for name, (tokens, _) in prompts.items()])
            )
            worker.wait_for_save(plan)
        finally:
            worker.shutdown()  # waits for the queued puts to reach the store
        base = base_namespace(
            stand_in_vllm_config(),
            engine_shape(stand_in_vllm_config(), stand_in_kv_cache_config(), 0),
            connector_settings(),
            0,
        )
        with KVStoreClient(server.target, namespace=base) as client:
            keys = {name: chunk_keys_of(side, request) for name, request in requests.items()}
            assert client.lookup(keys["plain"]) == 3 and client.lookup(keys["pinned"]) == 3
            assert client.lookup(keys["none"]) == 0
            rng = np.random.default_rng(0)
            for _ in range(60):  # one-off prompts: 60 x 256 KiB, far over dram + nvme
                client.put([rng.bytes(16)], [rng.bytes(256 * 1024)])
            assert client.lookup(keys["plain"]) == 0
            assert client.lookup(keys["pinned"]) == 3
            assert client.lookup(keys["none"]) == 0
            assert client.stats()["tiers"]["dram"]["retained_blocks"] == 3
    finally:
        server.stop()
