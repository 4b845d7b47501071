"""The ``[keys]`` settings (:mod:`kvstore.config.keys`) and their deprecated ``cluster.engine_*``
aliases."""

from __future__ import annotations

import logging

import pytest

from kvstore.config import load_config
from kvstore.deprecation import REMOVED_IN
from kvstore.errors import ConfigError
from kvstore.key_scheme import secret_fingerprint
from kvstore.keys import Namespace

CLUSTER = {"KVSTORE_CLUSTER_ENABLED": "1", "KVSTORE_CLUSTER_URL": "redis://127.0.0.1:1"}


def test_defaults_and_the_scheme_they_make() -> None:
    keys = load_config(env={}).keys
    assert (keys.chunk_size, keys.hash_algorithm, keys.namespace) == (256, "xxh3_128", "")
    assert keys.secret_env == "KVSTORE_HASH_SECRET"
    scheme = keys.scheme({})
    assert scheme.namespace is None and scheme.secret_check == ""  # no secret of its own
    config = load_config(
        env={
            "KVSTORE_KEYS_CHUNK_SIZE": "128",
            "KVSTORE_KEYS_HASH_ALGORITHM": "sha256",
            "KVSTORE_KEYS_NAMESPACE": '{"model": "m", "tenant": "t"}',
            "KVSTORE_KEYS_SECRET_ENV": "MY_SECRET",
        }
    )
    scheme = config.keys.scheme({"MY_SECRET": "s3"})
    assert (scheme.chunk_size, scheme.hash_algorithm) == (128, "sha256")
    assert scheme.namespace == Namespace(model="m", tenant="t")
    assert scheme.secret_env == "MY_SECRET" and scheme.secret_check == secret_fingerprint("s3")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVSTORE_KEYS_CHUNK_SIZE": "0"}, r"keys\.chunk_size must be >= 1, got 0"),
        ({"KVSTORE_KEYS_HASH_ALGORITHM": "md5"}, r"keys\.hash_algorithm must be one of"),
        ({"KVSTORE_KEYS_NAMESPACE": '{"modle": "m"}'}, r"keys\.namespace: unknown fields"),
        ({"KVSTORE_KEYS_NAMESPACE": "m"}, r"keys\.namespace: cannot use 'm': not JSON"),
        ({"KVSTORE_KEYS_SECRET_ENV": ""}, r"keys\.secret_env must name an environment variable"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_old_engine_settings_are_aliases_with_one_warning_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvstore.config.keys")
    config = load_config(
        env={
            **CLUSTER,
            "KVSTORE_CLUSTER_ENGINE_EVENTS": "tcp://127.0.0.1:5557",
            "KVSTORE_CLUSTER_ENGINE_NAMESPACE": '{"model": "m"}',
            "KVSTORE_CLUSTER_ENGINE_CHUNK_SIZE": "64",
            "KVSTORE_CLUSTER_ENGINE_HASH_ALGORITHM": "sha256",
        }
    )
    assert (config.keys.chunk_size, config.keys.hash_algorithm) == (64, "sha256")
    assert config.keys.namespace == '{"model": "m"}'
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1
    for old, new in (
        ("engine_namespace", "namespace"),
        ("engine_chunk_size", "chunk_size"),
        ("engine_hash_algorithm", "hash_algorithm"),
    ):
        assert f"cluster.{old} (set keys.{new} instead)" in lines[0]
    assert lines[0].endswith(f"; they are removed in kvstore {REMOVED_IN}")


def test_a_keys_setting_wins_over_its_old_alias(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvstore.config.keys")
    config = load_config(
        env={"KVSTORE_CLUSTER_ENGINE_CHUNK_SIZE": "64", "KVSTORE_KEYS_CHUNK_SIZE": "128"}
    )
    assert config.keys.chunk_size == 128
    assert "cluster.engine_chunk_size (set keys.chunk_size instead)" in caplog.text


def test_no_warning_without_old_settings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvstore.config.keys")
    load_config(env={"KVSTORE_KEYS_CHUNK_SIZE": "128"})
    assert not caplog.records
