"""The router's choice of key scheme from what the nodes publish (:mod:`kvstore.router.fleet_keys`):
the majority per model, the request's model where there are several, refusals named once, the
secret checked, the deprecated router.* settings only while nobody publishes."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvstore.deprecation import REMOVED_IN
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace
from kvstore.router.fleet_keys import FleetKeys, agreed_schemes
from kvstore.router.keys import RouterKeys
from kvstore.router.metrics import RouterMetrics

ENV = {"KVSTORE_HASH_SECRET": "s"}
M1 = KeyScheme.with_secret(Namespace(model="m1"), 128, env=ENV)
M1_256 = dataclasses.replace(M1, chunk_size=256)
M2 = KeyScheme.with_secret(Namespace(model="m2"), 64, env=ENV)
BARE_256 = dataclasses.replace(M1_256, namespace=None)


def fleet(env: dict[str, str] = ENV, fallback: RouterKeys | None = None) -> FleetKeys:
    keys = FleetKeys(None, RouterMetrics(), fallback, env=env)
    return keys


def test_the_majority_per_model_is_agreed_and_ties_are_stable() -> None:
    published = {"a": [M1], "b": [M1], "c": [M1_256], "d": [M2], "e": [BARE_256]}
    assert agreed_schemes(published) == {"m1": M1, "m2": M2}
    tie = agreed_schemes({"a": [M1], "c": [M1_256]})
    assert tie == agreed_schemes({"c": [M1_256], "a": [M1]})


def test_refusals_are_named_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvstore.router.fleet_keys")
    keys = fleet()
    published = {"a": [M1], "b": [M1], "c": [M1_256], "d": [BARE_256]}
    for _ in range(3):
        keys._update(published)
    assert keys.refused == {"c": "chunk_size 128 vs 256", "d": "chunk_size 128 vs 256"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "replica c refused for prefix routing: its key scheme differs (chunk_size 128 vs 256)",
        "replica d refused for prefix routing: its key scheme differs (chunk_size 128 vs 256)",
    ]
    keys._update({"a": [M1], "b": [M1], "c": [M1]})  # c fixed its settings
    assert keys.refused == {}
    assert "replica c accepted for prefix routing" in caplog.text


async def test_the_requests_model_picks_the_scheme() -> None:
    keys = fleet()
    keys._update({"a": [M1], "b": [M2]})
    m1, m2 = keys.keys_for("m1"), keys.keys_for("m2")
    assert m1 is not None and m2 is not None
    assert (m1.chunk_size, m2.chunk_size) == (128, 64)
    assert keys.keys_for("other") is None and keys.keys_for(None) is None
    keys._update({"a": [M1]})  # one model: every request uses it
    only = keys.keys_for("anything")
    assert only is not None and only.chunk_size == 128
    assert only.keys(list(range(256))) == [bytes(k) for k in M1.hasher(b"s").keys(list(range(256)))]


async def test_a_router_with_another_secret_routes_by_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys = fleet(env={"KVSTORE_HASH_SECRET": "other"})
    keys._update({"a": [M1]})
    keys._update({"a": [M1], "b": [M1]})
    assert keys.keys_for("m1") is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "$KVSTORE_HASH_SECRET differs" in errors[0].getMessage()


async def test_the_old_settings_are_a_fallback_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = RouterKeys(Namespace(model="m1"), 32, "s")
    keys = fleet(fallback=old)
    assert keys.keys_for("m1") is old and keys.keys_for("m1") is old
    assert (
        caplog.text.count("router.namespace/router.chunk_size/router.hash_algorithm is deprecated")
        == 1
    )
    assert f"removed in kvstore {REMOVED_IN}" in caplog.text
    keys._update({"a": [M1]})
    new = keys.keys_for("m1")
    assert new is not None and new.chunk_size == 128
