"""Tests of the ``[tenants.NAME]`` tables of a config file and of each tenant's own settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstore.config import TenantConfig, load_config
from kvstore.errors import ConfigError
from kvstore.server.tenancy import check_tenants, tenant_config

A = '[tenants.a]\nidentities = ["alice"]\nuids = [1000]\ndram = "64MiB"\nnvme = "1GiB"\n'
ENV = {"HOME": "/home/someone", "KVSTORE_NVME_PATH": "/data/nvme"}


def load(tmp_path: Path, text: str) -> tuple[TenantConfig, ...]:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return load_config(path, env=ENV).tenants


def test_tenant_tables_are_read_with_sizes(tmp_path: Path) -> None:
    tenants = load(
        tmp_path, A + '[tenants.b]\nidentities = ["bob", "ci"]\ngids = [2000]\nnvme = "2GiB"\n'
    )
    assert tenants == (
        TenantConfig("a", ("alice",), (1000,), dram=64 * 1024**2, nvme=1024**3),
        TenantConfig("b", ("bob", "ci"), (), (2000,), dram=0, nvme=2 * 1024**3),
    )


def test_no_tenants_is_one_shared_store(tmp_path: Path) -> None:
    assert load(tmp_path, "[server]\nworkers = 2\n") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (A + '[tenants.b]\nidentities = ["alice"]\ndram = "1MiB"\n', "in tenants a and b"),
        ('[tenants.a]\nidentities = ["x"]\ndram = "big"\n', r"\[tenants.a\]: cannot parse size"),
        ('[tenants.a]\nidentities = ["x"]\ndram = "1MiB"\nquota = 3\n', "takes only"),
        ('[tenants."A B"]\nidentities = ["x"]\ndram = "1MiB"\n', "a tenant name is"),
        ('[tenants.a]\ndram = "1MiB"\n', "identities must name at least one caller"),
        ('[tenants.a]\nidentities = ["x"]\n', "give dram or nvme a size"),
        ('[tenants.a]\nidentities = ["x"]\nuids = ["root"]\ndram = "1MiB"\n', "tenants.a"),
        ("tenants = 3\n", "one table per tenant"),
        ('[tenants.a]\nidentities = ["x"]\ndram = "1MiB"\nshm = "yes"\n', "shm must be true or"),
    ],
    ids=[
        "shared-identity",
        "bad-size",
        "unknown-key",
        "bad-name",
        "no-identity",
        "no-quota",
        "bad-uid",
        "not-a-table",
        "shm-not-a-bool",
    ],
)
def test_bad_tenant_tables_name_the_tenant_and_the_rule(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


def test_a_tenant_gets_its_own_places_and_quotas(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[redis]\nurl = "redis://r:6379"\n[shm]\nsocket = "/run/k.sock"\n' + A)
    config = load_config(path, env=ENV)
    own = tenant_config(config, config.tenants[0])
    assert own.dram.capacity == 64 * 1024**2
    assert (own.nvme.path, own.nvme.capacity) == ("/data/nvme/tenants/a", 1024**3)
    assert own.redis.key_prefix == "kvstore:v1:t:a:"
    # No shared memory unless the tenant says its engines trust each other with its arena.
    assert own.shm.socket == ""
    trusting = dataclasses.replace(config.tenants[0], shm=True)
    assert tenant_config(config, trusting).shm.socket == "/run/k.sock"
    # A quarter of its own arena, at least 64 MiB, never above the server-wide bound.
    assert own.server.inflight_bytes == 64 * 1024**2
    assert own.tenants == ()


def test_operators_are_a_list_in_toml_and_comma_separated_elsewhere(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[auth]\noperators = ["ops", " prom "]\n' + A)
    assert load_config(path, env=ENV).auth.operator_identities == {"ops", "prom"}
    env = {**ENV, "KVSTORE_AUTH_OPERATORS": "ops,prom"}
    assert load_config(env=env).auth.operator_identities == {"ops", "prom"}


@pytest.mark.parametrize(
    ("operators", "message"),
    [
        ('["nobody-known"]', r"auth.operators names \['nobody-known'\], which are no token"),
        ('["alice"]', r"in auth.operators and in tenants.a.identities"),
    ],
    ids=["not-a-token", "also-a-tenant"],
)
def test_operators_must_be_token_names_of_no_tenant(
    tmp_path: Path, operators: str, message: str
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {'a' * 64}\nops {'b' * 64}\n")
    path = tmp_path / "kvstore.toml"
    path.write_text(f'[auth]\ntokens_file = "{tokens}"\noperators = {operators}\n' + A)
    with pytest.raises(ConfigError, match=message):
        check_tenants(load_config(path, env=ENV))
