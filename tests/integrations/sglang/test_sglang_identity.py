"""What names an SGLang page in kvstore, without SGLang: the extra config's settings, the page's
namespace (everything that decides its bytes), its key, the refused pools and set-ups
(:mod:`kvstore.integrations.sglang.settings`, :mod:`~kvstore.integrations.sglang.identity`)."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness.sglang_pool_stand_in import HostPoolStandIn

from kvstore.errors import ConfigError
from kvstore.integrations.sglang.identity import (
    PageKeys,
    check_parallelism,
    namespace_for,
    pool_shape,
)
from kvstore.integrations.sglang.scheme import differences
from kvstore.integrations.sglang.settings import BackendSettings
from kvstore.key_scheme import KeyScheme

BASE = {"backend_name": "kvstore", "module_path": "m", "class_name": "C", "interface_v1": 1}
HASH = "ab" * 32  # an SGLang page hash: a SHA-256 hex digest


def config(**changes: Any) -> SimpleNamespace:
    """A stand-in for SGLang's HiCacheStorageConfig (only the fields the backend reads)."""
    fields = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_size": 1,
        "should_split_heads": False,
        "model_name": "tiny-llama",
        "is_mla_model": False,
    }
    return SimpleNamespace(**{**fields, **changes})


def settings(**extra: Any) -> BackendSettings:
    return BackendSettings.from_extra_config({**BASE, "target": "127.0.0.1:1", **extra}, env={})


def refused(caplog: pytest.LogCaptureFixture, extra: dict[str, Any]) -> str:
    caplog.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as raised:
        BackendSettings.from_extra_config(extra, env={})
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert lines == [str(raised.value)]  # one line, the same the exception says
    return lines[0]


def test_settings_take_the_backend_keys_and_let_sglangs_through() -> None:
    chosen = settings(tenant="acme", timeout_s=0.25, revision="v2", hash_algorithm="sha256")
    assert (chosen.tenant, chosen.timeout_s, chosen.revision) == ("acme", 0.25, "v2")
    assert chosen.pinned == {"target", "tenant", "timeout_s", "revision", "hash_algorithm"}
    assert settings().secret == ""
    from_env = BackendSettings.from_extra_config(
        {"target": "h:1"}, env={"KVSTORE_HASH_SECRET": "s3"}
    )
    assert from_env.secret == "s3"
    assert "s3" not in repr(from_env)


def test_each_bad_setting_is_refused_with_one_line_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert "'tenat'" in refused(caplog, {**BASE, "target": "h:1", "tenat": "x"})
    assert "'target'" in refused(caplog, {**BASE})
    assert "timeout_s" in refused(caplog, {"target": "h:1", "timeout_s": "soon"})
    assert "lookup_timeout_s" in refused(caplog, {"target": "h:1", "lookup_timeout_s": 0})
    assert "hash_algorithm" in refused(caplog, {"target": "h:1", "hash_algorithm": "md5"})
    assert "tenant" in refused(caplog, {"target": "h:1", "tenant": 7})


def fingerprint(pool: HostPoolStandIn, conf: SimpleNamespace, chosen: BackendSettings) -> bytes:
    return namespace_for(pool_shape(pool), conf, chosen).fingerprint()


def test_the_namespace_changes_with_everything_that_decides_a_pages_bytes() -> None:
    pool = HostPoolStandIn("layer_first")
    base = fingerprint(pool, config(), settings())
    shaped: dict[str, dict[str, Any]] = {
        "dtype": {"dtype": torch.float16},
        "layers": {"layers": 4},
        "heads": {"heads": 4},
        "head size": {"head_dim": 16},
        "page size": {"page_size": 8},
        "attention kind": {"mla": True},
    }
    others = {
        "model": fingerprint(pool, config(model_name="other"), settings()),
        "revision": fingerprint(pool, config(), settings(revision="v2")),
        "tenant": fingerprint(pool, config(), settings(tenant="acme")),
        "cache salt": fingerprint(pool, config(), settings(cache_salt="blue")),
        "tp rank": fingerprint(pool, config(tp_rank=1, tp_size=2), settings()),
        "tp size": fingerprint(pool, config(tp_size=2), settings()),
        "pp stage": fingerprint(pool, config(pp_rank=1, pp_size=2), settings()),
    }
    for name, change in shaped.items():
        changed = HostPoolStandIn("layer_first", **change)
        others[name] = fingerprint(changed, config(), settings())
    assert base not in others.values()
    assert len(set(others.values())) == len(others)


def test_host_layouts_share_a_namespace_because_pages_are_stored_in_one_order() -> None:
    for mla in (False, True):
        prints = {
            fingerprint(HostPoolStandIn(layout, mla=mla), config(), settings())
            for layout in ("layer_first", "page_first", "page_first_direct")
        }
        assert len(prints) == 1
    layout = namespace_for(pool_shape(HostPoolStandIn("page_first")), config(), settings())
    assert layout.cache_layout.startswith("sglang/mha/")  # never a vLLM layout's name


def test_mla_is_one_namespace_on_every_rank_and_tp_size() -> None:
    pool = HostPoolStandIn("layer_first", mla=True)
    prints = {
        fingerprint(pool, config(tp_rank=rank, tp_size=size, is_mla_model=True), settings())
        for size in (1, 2, 4)
        for rank in range(size)
    }
    assert len(prints) == 1


def test_page_keys_differ_by_namespace_and_secret_and_never_collide_across_strings() -> None:
    namespace = namespace_for(pool_shape(HostPoolStandIn("layer_first")), config(), settings())
    keys = PageKeys(namespace, 4, b"s", "xxh3_128")
    other_rank = dataclasses.replace(namespace, tp_rank=1, tp_size=2)
    assert keys.of([HASH]) == keys.of([HASH])  # stable
    assert keys.of([HASH]) != PageKeys(other_rank, 4, b"s", "xxh3_128").of([HASH])
    assert keys.of([HASH]) != PageKeys(namespace, 4, b"t", "xxh3_128").of([HASH])
    assert keys.of([HASH]) != PageKeys(namespace, 4, b"s", "sha256").of([HASH])
    assert len({*keys.of([HASH, "cd" * 32, "not hex", "00"]), *keys.of(["\x00"])}) == 5
    assert all(len(key) == 16 for key in keys.of([HASH, "x"]))


def test_pools_and_set_ups_the_backend_cannot_store_are_refused() -> None:
    with pytest.raises(ConfigError, match="page_head"):
        pool_shape(HostPoolStandIn("page_head"))
    split_dims = HostPoolStandIn("layer_first")
    split_dims.v_head_dim = 4
    with pytest.raises(ConfigError, match="head sizes differ"):
        pool_shape(split_dims)
    dcp = HostPoolStandIn("layer_first", mla=True)
    dcp.dcp_size = 2
    with pytest.raises(ConfigError, match="dcp_size 2"):
        pool_shape(dcp)
    with pytest.raises(ConfigError, match="attn_cp_size 2"):
        check_parallelism(config(attn_cp_size=2))
    with pytest.raises(ConfigError, match="tp_lcm_size"):
        check_parallelism(config(should_split_heads=True))
    check_parallelism(config())


def test_the_page_size_must_be_the_stores_chunk_size() -> None:
    store = KeyScheme(chunk_size=16, hash_algorithm="sha256")
    assert differences(16, "xxh3_128", store, algorithm_pinned=False) == []
    assert differences(16, "xxh3_128", store, algorithm_pinned=True) == [
        "the extra config's hash_algorithm 'xxh3_128' differs from the store's "
        "keys.hash_algorithm 'sha256'"
    ]
    assert differences(64, "sha256", store, algorithm_pinned=True) == [
        "SGLang's --page-size 64 differs from the store's keys.chunk_size 16"
    ]
