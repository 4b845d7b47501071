"""The sections split out of ``[server]`` (``[shm]``, ``[ucx]``, ``[auth]``), the old names that
still reach them for one release, and the settings' metadata the loader, the flags and the README
table are made from."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstore.cli import SERVE_SECTIONS, _parsers
from kvstore.cli.flags import flag_overrides
from kvstore.config import (
    deprecated_names,
    env_var,
    load_config,
    setting_fields,
    setting_metas,
    setting_names,
    unknown_env_vars,
)
from kvstore.config.meta import KINDS, SettingMeta, setting
from kvstore.deprecation import REMOVED_IN
from kvstore.errors import ConfigError

# The machine-dependent defaults, pinned: nothing here depends on this machine.
ENV = {"KVSTORE_DRAM_CAPACITY": "64MiB", "KVSTORE_NVME_PATH": ""}

MOVED = {
    "server.shm_socket": ("shm.socket", "/run/k.sock", "/run/k.sock"),
    "server.shm_socket_mode": ("shm.socket_mode", "0600", 0o600),
    "server.shm_max_connections": ("shm.max_connections", "9", 9),
    "server.shm_max_connections_per_uid": ("shm.max_connections_per_uid", "3", 3),
    "server.shm_session_bytes": ("shm.session_bytes", "1MiB", 1024**2),
    "server.shm_frame_timeout_s": ("shm.frame_timeout_s", "2.5", 2.5),
    "server.ucx_listen": ("ucx.listen", "127.0.0.1:0", "127.0.0.1:0"),
    "server.ucx_transfer_timeout_s": ("ucx.transfer_timeout_s", "7", 7.0),
    "server.tokens_file": ("auth.tokens_file", "/etc/t", "/etc/t"),
    "server.allow_unauthenticated": ("auth.allow_unauthenticated", "true", True),
    "server.operators": ("auth.operators", "ops,prom", "ops,prom"),
}


def value_of(config: object, name: str) -> object:
    section, field = name.split(".")
    return getattr(getattr(config, section), field)


def test_every_server_setting_that_moved_has_its_old_name() -> None:
    old = deprecated_names()
    assert set(MOVED) <= set(old)
    assert {"server.tls_cert", "server.tls_key", "server.tls_client_ca"} <= set(old)
    assert all(new in setting_names() for new in old.values())
    assert not set(old) & set(setting_names())


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_variable_still_sets_the_new_setting_with_one_warning(
    old: str, caplog: pytest.LogCaptureFixture
) -> None:
    new, text, value = MOVED[old]
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        config = load_config(env={**ENV, env_var(old): text})
    assert value_of(config, new) == value
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{env_var(old)} is deprecated: use {env_var(new)}; it is removed in kvstore {REMOVED_IN}"
    ]


def test_an_old_key_in_the_file_still_works_and_the_warning_names_the_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[server]\nworkers = 2\nshm_socket = "/run/k.sock"\noperators = ["ops"]\n')
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        config = load_config(path, env=ENV)
    assert (config.server.workers, config.shm.socket) == (2, "/run/k.sock")
    assert config.auth.operator_identities == {"ops"}
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert warnings == [
        f"[server] operators in {path} is deprecated: use [auth] operators; "
        f"it is removed in kvstore {REMOVED_IN}",
        f"[server] shm_socket in {path} is deprecated: use [shm] socket; "
        f"it is removed in kvstore {REMOVED_IN}",
    ]


def test_the_new_name_wins_over_the_old_in_the_same_place(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[server]\nucx_listen = "127.0.0.1:1"\n[ucx]\nlisten = "127.0.0.1:2"\n')
    assert load_config(path, env=ENV).ucx.listen == "127.0.0.1:2"
    env = {**ENV, "KVSTORE_SERVER_UCX_LISTEN": "127.0.0.1:1", "KVSTORE_UCX_LISTEN": "127.0.0.1:3"}
    assert load_config(env=env).ucx.listen == "127.0.0.1:3"
    # Each source still lays over the one before: an old variable beats the new key in the file.
    env = {**ENV, "KVSTORE_SERVER_UCX_LISTEN": "127.0.0.1:4"}
    assert load_config(path, env=env).ucx.listen == "127.0.0.1:4"


def test_old_variables_are_known_not_typos() -> None:
    assert unknown_env_vars({"KVSTORE_SERVER_SHM_SOCKET": "x", "KVSTORE_SHM_SOCKET": "y"}) == []


def test_errors_name_the_new_setting_even_when_set_by_its_old_name() -> None:
    with pytest.raises(ConfigError, match=r"shm\.socket_mode \(from KVSTORE_SERVER_SHM_SOCKET_M"):
        load_config(env={**ENV, "KVSTORE_SERVER_SHM_SOCKET_MODE": "rw"})
    with pytest.raises(ConfigError, match=r"auth\.tls_cert and auth\.tls_key go together"):
        load_config(env={**ENV, "KVSTORE_AUTH_TLS_CERT": "/c.pem"})


# --- the metadata ---------------------------------------------------------------------------------


def test_every_setting_is_described() -> None:
    metas = setting_metas()
    assert list(metas) == setting_names()
    for name, meta in metas.items():
        assert meta.help.strip(), name
        assert meta.kind in KINDS, name


def test_choices_are_what_the_section_accepts() -> None:
    """A choice's listed values are accepted and anything else is refused naming them."""
    choices = {n: m for n, m in setting_metas().items() if m.kind == "choice"}
    assert {"policy.eviction", "integrity.mac", "cluster.peer_transport", "router.policy"} <= set(
        choices
    )
    # Peers are found through the cluster index: cluster.shared_data needs it on.
    cluster = {"cluster.enabled": True, "redis.url": "redis://127.0.0.1:1"}
    for name, meta in choices.items():
        for value in meta.choices:
            config = load_config(env=ENV, overrides={**cluster, name: value})
            assert value_of(config, name) == value
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")) as refused:
            load_config(env=ENV, overrides={name: "no-such-value"})
        assert all(value in str(refused.value) for value in meta.choices), name


def test_sizes_and_lists_follow_their_kind() -> None:
    kinds = {n: m.kind for n, m in setting_metas().items()}
    assert kinds["server.max_block_bytes"] == kinds["shm.session_bytes"] == "size"
    assert kinds["auth.operators"] == kinds["router.replicas"] == "list"
    config = load_config(env=ENV, overrides={"router.replicas": ["http://a=1", "http://b=2"]})
    assert config.router.replicas == "http://a=1,http://b=2"
    with pytest.raises(ConfigError, match=r"shm\.session_bytes .*KiB"):
        load_config(env=ENV, overrides={"shm.session_bytes": "lots"})


def test_a_setting_declared_wrong_is_refused_where_it_is_written() -> None:
    with pytest.raises(ValueError, match="kind"):
        SettingMeta(help="x", kind="colour")
    with pytest.raises(ValueError, match="choices"):
        SettingMeta(help="x", choices=("a",))
    with pytest.raises(ValueError, match="--"):
        setting(0, help="x", flag="-x")


# --- the flags ------------------------------------------------------------------------------------


def test_every_flag_comes_from_a_setting_and_reaches_it() -> None:
    _, commands = _parsers()
    for command, sections in (("serve", SERVE_SECTIONS), ("router", ("router",))):
        parser = commands[command]
        dests = parser.get_default("setting_flags")
        flagged = {n for n, m in setting_metas().items() if m.flag and n.split(".")[0] in sections}
        assert set(dests.values()) == flagged, command
    sections = tuple(dict.fromkeys(n.split(".")[0] for n in setting_fields()))
    assert sections == (*SERVE_SECTIONS, "router")


# Every flag the tests, scripts and docs use today, and the setting it sets.
SERVE_FLAGS = {
    "--listen": "server.listen",
    "--max-block-bytes": "server.max_block_bytes",
    "--metrics-listen": "server.metrics_listen",
    "--shm-socket": "shm.socket",
    "--shm-socket-mode": "shm.socket_mode",
    "--ucx-listen": "ucx.listen",
    "--tls-cert": "auth.tls_cert",
    "--tls-key": "auth.tls_key",
    "--tls-client-ca": "auth.tls_client_ca",
    "--tokens-file": "auth.tokens_file",
    "--dram-capacity": "dram.capacity",
    "--dram-page-size": "dram.page_size",
    "--nvme-path": "nvme.path",
    "--nvme-capacity": "nvme.capacity",
    "--redis-url": "redis.url",
    "--redis-ttl": "redis.ttl_s",
}
ROUTER_FLAGS = {
    "--listen": "router.listen",
    "--namespace": "router.namespace",
    "--chunk-size": "router.chunk_size",
    "--tokenizer": "router.tokenizer",
    "--tenant": "router.tenant",
    "--max-body-bytes": "router.max_body_bytes",
}


@pytest.mark.parametrize("flag", sorted(SERVE_FLAGS))
def test_each_serve_flag_keeps_its_name(flag: str) -> None:
    parser, _ = _parsers()
    args = parser.parse_args(["serve", flag, "1"])
    assert flag_overrides(args, args.setting_flags) == {SERVE_FLAGS[flag]: "1"}


def test_router_flags_keep_their_names() -> None:
    parser, _ = _parsers()
    for flag, name in ROUTER_FLAGS.items():
        args = parser.parse_args(["router", flag, "1"])
        assert flag_overrides(args, args.setting_flags) == {name: "1"}
    args = parser.parse_args(
        ["router", "--replica", "a=1", "--replica", "b=2", "--policy", "least_loaded",
         "--prefill", "p=1", "--decode", "d=2", "--decode", "e=3"]
    )  # fmt: skip
    assert flag_overrides(args, args.setting_flags) == {
        "router.replicas": "a=1,b=2",
        "router.policy": "least_loaded",
        "router.prefill": "p=1",
        "router.decode": "d=2,e=3",
    }
    args = parser.parse_args(["serve", "--allow-unauthenticated"])
    assert flag_overrides(args, args.setting_flags) == {"auth.allow_unauthenticated": True}


def test_serve_help_is_grouped_by_section() -> None:
    _, commands = _parsers()
    text = commands["serve"].format_help()
    headings = [line[:-1] for line in text.splitlines() if line.endswith(" settings:")]
    assert headings == [
        "[server] settings",
        "[shm] settings",
        "[ucx] settings",
        "[auth] settings",
        "[dram] settings",
        "[nvme] settings",
        "[redis] settings",
    ]
    assert "--shm-socket-mode MODE" in text and "(default: 0660)" in text


def test_a_renamed_flag_keeps_its_old_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import dataclasses

    import kvstore.cli.flags as flags

    @dataclasses.dataclass(frozen=True)
    class Section:
        timeout_s: float = setting(
            1.0, help="a timeout", flag="--new-timeout", flag_aliases=("--old-timeout",)
        )

    (field,) = dataclasses.fields(Section)
    monkeypatch.setattr(flags, "setting_fields", lambda: {"demo.timeout_s": field})
    parser = argparse.ArgumentParser()
    dests = flags.add_setting_flags(parser, ("demo",), None)
    for spelling in ("--new-timeout", "--old-timeout"):
        args = parser.parse_args([spelling, "2.5"])
        assert flags.flag_overrides(args, dests) == {"demo.timeout_s": "2.5"}
    assert "[demo] settings" in parser.format_help()
