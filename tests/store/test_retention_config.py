"""Where the longest retention comes from: ``policy.max_retention_s`` (file, environment) and a
tenant's own ``max_retention_s``; and the retention trailer of shared-memory frames."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.protocol.shm_frames import Cursor, ProtocolError, pack_retention
from kvstore.retention import DEFAULT_MAX_RETENTION_S, KEEP, Retention
from kvstore.server.tenancy import tenant_config

ENV = {"KVSTORE_DRAM_CAPACITY": "64MiB", "KVSTORE_NVME_PATH": ""}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return path


def test_the_default_and_the_environment(tmp_path: Path) -> None:
    assert load_config(env=ENV).policy.max_retention_s == DEFAULT_MAX_RETENTION_S
    env = {**ENV, "KVSTORE_POLICY_MAX_RETENTION_S": "86400"}
    assert load_config(env=env).policy.max_retention_s == 86400
    with pytest.raises(ConfigError, match=r"policy\.max_retention_s"):
        load_config(env={**ENV, "KVSTORE_POLICY_MAX_RETENTION_S": "-1"})


def test_a_tenant_maximum_replaces_the_servers_for_its_store(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            "[policy]\nmax_retention_s = 600\n"
            '[tenants.a]\nidentities = ["a"]\ndram = "8MiB"\nmax_retention_s = 60\n'
            '[tenants.b]\nidentities = ["b"]\ndram = "8MiB"\n',
        ),
        env=ENV,
    )
    a, b = config.tenants
    assert a.max_retention_s == 60 and b.max_retention_s is None
    assert tenant_config(config, a).policy.max_retention_s == 60
    assert tenant_config(config, b).policy.max_retention_s == 600


@pytest.mark.parametrize("value", ['"an hour"', "-5", "true"])
def test_a_bad_tenant_maximum_names_the_setting(tmp_path: Path, value: str) -> None:
    text = f'[tenants.a]\nidentities = ["a"]\ndram = "8MiB"\nmax_retention_s = {value}\n'
    with pytest.raises(ConfigError, match=r"tenants\.a\.max_retention_s"):
        load_config(write(tmp_path, text), env=ENV)


def test_the_shm_retention_trailer_is_optional_and_checked() -> None:
    assert Cursor(b"").retention() == KEEP
    assert Cursor(pack_retention(Retention(90, "fast"))).retention() == Retention(90, "fast")
    with pytest.raises(ProtocolError, match="retention tiers"):
        Cursor(struct.pack("<dB", 1.0, 7)).retention()
    with pytest.raises(InvalidRequestError, match=">= 0"):
        Cursor(struct.pack("<dB", -1.0, 0)).retention()
    with pytest.raises(ProtocolError, match="truncated"):
        Cursor(b"\x00\x01").retention()
