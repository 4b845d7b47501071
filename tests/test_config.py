"""Tests of :mod:`kvstore.config`: sizes, validation and the defaults < file < env < flags merge.

Every ``load_config`` call passes an explicit ``env`` mapping, so the real environment of the test
run never leaks in.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pwd
import re
from pathlib import Path
from typing import Any, NoReturn

import pytest

import kvstore.config as config_module
from kvstore.config import (
    Config,
    DramConfig,
    NvmeConfig,
    ServerConfig,
    ShmConfig,
    default_inflight_bytes,
    format_size,
    load_config,
    parse_size,
)
from kvstore.errors import ConfigError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
UNITS_MESSAGE = "KiB, MiB, GiB, TiB, KB, MB, GB, TB"


def write_toml(tmp_path: Path, text: str, name: str = "kvstore.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- parse_size / format_size ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("123456789", 123456789),
        ("7B", 7),
        ("7b", 7),
        ("1k", 1000),
        ("1KB", 1000),
        ("1kb", 1000),
        ("1M", 1000**2),
        ("1MB", 1000**2),
        ("1G", 1000**3),
        ("1GB", 1000**3),
        ("1T", 1000**4),
        ("1TB", 1000**4),
        ("1KiB", KiB),
        ("1MiB", MiB),
        ("1GiB", GiB),
        ("1TiB", TiB),
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("4gib", 4 * GiB),
        ("4GIB", 4 * GiB),
        ("  4 GiB  ", 4 * GiB),
        ("64 KiB", 64 * KiB),
        ("1.5GB", 1_500_000_000),
        ("1.5KiB", 1536),
        ("0.5MiB", 512 * KiB),
        ("2.25GiB", 2 * GiB + GiB // 4),
        ("1.0TiB", TiB),
        ("0.1KiB", 102),  # fractional bytes round down
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", [0, 1, 4096, 17 * GiB])
def test_parse_size_int_passes_through(value: int) -> None:
    assert parse_size(value) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "abc",
        "GiB",
        "-1",
        "-1GiB",
        "1.5.5GiB",
        ".5GiB",
        "1PiB",
        "1 PB",
        "1e9",
        "1,024",
        "1 G iB",
        "1Gibibyte",
        "0x10",
        "4 GiB extra",
    ],
)
def test_parse_size_rejects_bad_strings_naming_units(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    assert UNITS_MESSAGE in str(info.value)
    assert repr(text) in str(info.value)


def test_parse_size_rejects_negative_int() -> None:
    with pytest.raises(ConfigError, match=">= 0"):
        parse_size(-1)


def test_parse_size_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        parse_size("lots")


def test_parse_size_large_integer_is_exact() -> None:
    assert parse_size(str(2**53 + 1)) == 2**53 + 1


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (KiB, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (MiB, "1.0 MiB"),
        (MiB - 1, "1024.0 KiB"),
        (3 * GiB, "3.0 GiB"),
        (GiB + GiB // 2, "1.5 GiB"),
        (TiB, "1.0 TiB"),
        (5 * 1024 * TiB, "5120.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_size(num_bytes: int, expected: str) -> None:
    assert format_size(num_bytes) == expected


@pytest.mark.parametrize("num_bytes", [0, 512, KiB, 1536, 64 * MiB, 3 * GiB + GiB // 2, 2 * TiB])
def test_format_size_round_trips_through_parse_size(num_bytes: int) -> None:
    assert parse_size(format_size(num_bytes)) == num_bytes


# --- defaults -------------------------------------------------------------------------------------


def test_defaults_without_file_or_env() -> None:
    config = load_config(env={})
    inflight = default_inflight_bytes(config.dram.capacity)
    assert config.server == ServerConfig(inflight_bytes=inflight)
    assert config.server.listen == "127.0.0.1:50051"
    assert config.server.max_block_bytes == 64 * MiB
    assert config.server.workers == 4
    assert config.dram.page_size == 64 * KiB
    assert 0 <= config.dram.capacity <= 16 * GiB
    assert config.dram.capacity % MiB == 0
    assert config.nvme.capacity == 8 * GiB


def meminfo(available: int) -> str:
    """``/proc/meminfo`` text saying ``available`` bytes (whole KiB) are available."""
    return f"MemTotal:       99999999 kB\nMemAvailable:   {available // KiB} kB\nCached: 1 kB\n"


def test_default_dram_capacity_is_a_quarter_capped_and_rounded() -> None:
    assert config_module.default_dram_capacity(10 * GiB + 123) == 10 * GiB // 4 // MiB * MiB
    assert config_module.default_dram_capacity(4 * MiB + 5 * KiB) == MiB
    assert config_module.default_dram_capacity(512 * GiB) == 16 * GiB
    defaults = config_module.machine_defaults({}, meminfo=meminfo(512 * GiB))
    assert defaults["dram.capacity"] == 16 * GiB
    defaults = config_module.machine_defaults({}, meminfo=meminfo(10 * GiB))
    assert defaults["dram.capacity"] == 10 * GiB // 4


def test_available_memory_reads_memavailable_else_assumes_4_gib() -> None:
    assert config_module.available_memory(meminfo(10 * GiB)) == 10 * GiB
    assert config_module.available_memory("MemTotal: 1 kB\n") == 4 * GiB
    assert config_module.available_memory() > 0  # this machine's /proc/meminfo


def test_default_nvme_path_follows_xdg_data_home(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path), "HOME": "/home/elsewhere"}
    defaults = config_module.machine_defaults(env, meminfo=meminfo(GiB))
    assert defaults["nvme.path"] == str(tmp_path / "kvstore" / "nvme")
    assert load_config(env=env).nvme.path == str(tmp_path / "kvstore" / "nvme")


def test_default_nvme_path_without_xdg_data_home_is_under_home() -> None:
    defaults = config_module.machine_defaults({"HOME": "/home/someone"}, meminfo="")
    assert defaults["nvme.path"] == "/home/someone/.local/share/kvstore/nvme"
    # No HOME either: the password database's home, as Path.home() would find it.
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    no_home = config_module.machine_defaults({}, meminfo="")["nvme.path"]
    assert no_home == str(home / ".local" / "share" / "kvstore" / "nvme")


class _NoEnviron(dict[str, str]):
    """Stands in for ``os.environ``: any read of it fails the test."""

    def _read(self, *args: object) -> NoReturn:
        raise AssertionError(f"os.environ was read {args}")

    __getitem__ = __contains__ = get = keys = items = __iter__ = __len__ = _read


def test_load_config_with_an_env_reads_no_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", "/distinctive-xdg")
    monkeypatch.setenv("HOME", "/distinctive-home")
    monkeypatch.setenv("KVSTORE_SERVER_WORKERS", "7")
    monkeypatch.setenv("KVSTORE_FORCE_CUDA_CHECK", "1")
    config = load_config(env={})
    assert not config.nvme.path.startswith(("/distinctive-xdg", "/distinctive-home"))
    assert config.server.workers == 4
    assert config.dram.force_cuda_check is False
    with monkeypatch.context() as patch:
        patch.setattr(os, "environ", _NoEnviron())
        assert load_config(env={"HOME": "/h"}).nvme.path == "/h/.local/share/kvstore/nvme"
    # Without an env, the process environment is the env.
    assert load_config().nvme.path == "/distinctive-xdg/kvstore/nvme"


def test_dataclasses_are_plain_data() -> None:
    """Machine-dependent settings have no default in the dataclasses: the loader supplies them."""
    with pytest.raises(TypeError):
        DramConfig()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        NvmeConfig()  # type: ignore[call-arg]
    config = Config(dram=DramConfig(capacity=MiB), nvme=NvmeConfig(path=""))
    assert config.server == ServerConfig()
    assert config.dram.page_size == 64 * KiB


def test_force_cuda_check_is_a_setting_with_its_old_variable_kept() -> None:
    assert load_config(env={}).dram.force_cuda_check is False
    assert load_config(env={"KVSTORE_DRAM_FORCE_CUDA_CHECK": "true"}).dram.force_cuda_check
    assert not load_config(env={"KVSTORE_DRAM_FORCE_CUDA_CHECK": "0"}).dram.force_cuda_check
    # The name from before the loader read it: any non-empty value turns it on, as it did.
    assert load_config(env={"KVSTORE_FORCE_CUDA_CHECK": "yes"}).dram.force_cuda_check
    assert not load_config(env={"KVSTORE_FORCE_CUDA_CHECK": ""}).dram.force_cuda_check
    both = {"KVSTORE_FORCE_CUDA_CHECK": "1", "KVSTORE_DRAM_FORCE_CUDA_CHECK": "off"}
    assert not load_config(env=both).dram.force_cuda_check
    with pytest.raises(ConfigError, match=r"dram\.force_cuda_check"):
        load_config(env={"KVSTORE_DRAM_FORCE_CUDA_CHECK": "maybe"})


def test_setting_names_and_env_vars() -> None:
    names = config_module.setting_names()
    assert {"server.listen", "server.workers", "dram.capacity", "dram.page_size"} <= set(names)
    assert {"nvme.path", "nvme.capacity", "server.shutdown_grace_s"} <= set(names)
    assert config_module.env_var("dram.capacity") == "KVSTORE_DRAM_CAPACITY"
    assert config_module.env_var("server.shutdown_grace_s") == "KVSTORE_SERVER_SHUTDOWN_GRACE_S"
    env_vars = [config_module.env_var(n) for n in names]
    assert len(set(env_vars)) == len(names)


# --- precedence -----------------------------------------------------------------------------------

LAYER_VALUES = {"file": 2, "env": 3, "override": 5}


@pytest.mark.parametrize(
    "layers",
    [c for n in range(4) for c in itertools.combinations(["file", "env", "override"], n)],
    ids=lambda layers: "+".join(layers) or "defaults",
)
def test_precedence_defaults_file_env_overrides(tmp_path: Path, layers: tuple[str, ...]) -> None:
    path = write_toml(tmp_path, "[server]\nworkers = 2\n") if "file" in layers else None
    env = {"KVSTORE_SERVER_WORKERS": "3"} if "env" in layers else {}
    overrides = {"server.workers": 5} if "override" in layers else {}
    config = load_config(path, env=env, overrides=overrides)
    expected = LAYER_VALUES[layers[-1]] if layers else 4
    assert config.server.workers == expected


def test_layers_merge_per_setting(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
[server]
listen = "0.0.0.0:6000"
workers = 2
shutdown_grace_s = 1.5

[dram]
capacity = "256MiB"
page_size = 8192

[nvme]
path = "/var/lib/kvstore"
capacity = 2147483648
""",
    )
    env = {"KVSTORE_DRAM_PAGE_SIZE": "16KiB", "KVSTORE_SERVER_WORKERS": "3"}
    config = load_config(path, env=env, overrides={"server.workers": 5, "dram.capacity": "1GiB"})
    assert config.server == ServerConfig(listen="0.0.0.0:6000", workers=5, shutdown_grace_s=1.5)
    assert config.dram == DramConfig(capacity=GiB, page_size=16 * KiB)
    assert config.nvme == NvmeConfig(path="/var/lib/kvstore", capacity=2 * GiB)


def test_env_values_are_coerced_to_field_types() -> None:
    env = {
        "KVSTORE_SERVER_LISTEN": "[::1]:7000",
        "KVSTORE_SERVER_MAX_BLOCK_BYTES": "1MiB",
        "KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": "100",
        "KVSTORE_SERVER_SHUTDOWN_GRACE_S": "2.5",
        "KVSTORE_SERVER_WORKERS": "8",
        "KVSTORE_DRAM_CAPACITY": "1.5GiB",
        "KVSTORE_DRAM_PAGE_SIZE": "4096",
        "KVSTORE_NVME_PATH": "",
        "KVSTORE_NVME_CAPACITY": "0",
    }
    config = load_config(env=env)
    assert config.server == ServerConfig(
        listen="[::1]:7000",
        max_block_bytes=MiB,
        max_keys_per_request=100,
        shutdown_grace_s=2.5,
        workers=8,
        inflight_bytes=(GiB + GiB // 2) // 4,  # follows dram.capacity
    )
    assert config.dram == DramConfig(capacity=GiB + GiB // 2, page_size=4096)
    assert config.nvme == NvmeConfig(path="", capacity=0)  # an empty path disables the tier
    assert isinstance(config.server.shutdown_grace_s, float)
    assert isinstance(config.server.workers, int)


def test_unrelated_env_vars_are_ignored() -> None:
    env = {"KVSTORE_BOGUS": "1", "KVSTORE_DRAM_BOGUS": "2", "kvstore_server_workers": "9"}
    assert load_config(env=env).server.workers == 4


def test_none_override_is_ignored(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[server]\nworkers = 2\n")
    env = {"KVSTORE_DRAM_PAGE_SIZE": "8KiB"}
    config = load_config(path, env=env, overrides={"server.workers": None, "dram.page_size": None})
    assert config.server.workers == 2
    assert config.dram.page_size == 8 * KiB


def test_overrides_accept_strings_and_ints() -> None:
    config = load_config(env={}, overrides={"dram.capacity": "2GiB", "dram.page_size": 8192})
    assert config.dram == DramConfig(capacity=2 * GiB, page_size=8192)


# --- the config file ------------------------------------------------------------------------------


def test_kvstore_config_env_var_names_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[server]\nlisten = '10.0.0.1:1234'\n")
    config = load_config(env={"KVSTORE_CONFIG": str(path)})
    assert config.server.listen == "10.0.0.1:1234"


def test_explicit_path_beats_kvstore_config(tmp_path: Path) -> None:
    chosen = write_toml(tmp_path, "[server]\nworkers = 7\n", "chosen.toml")
    other = write_toml(tmp_path, "[server]\nworkers = 9\n", "other.toml")
    assert load_config(chosen, env={"KVSTORE_CONFIG": str(other)}).server.workers == 7


def test_empty_kvstore_config_means_no_file() -> None:
    assert load_config(env={"KVSTORE_CONFIG": ""}).server.workers == 4


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(missing, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(env={"KVSTORE_CONFIG": str(missing)})


def test_malformed_toml_is_config_error(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[server\nworkers = \n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(path, env={})


@pytest.mark.parametrize(
    "text", ["[cache]\nurl = 'redis://x'\n", "workers = 4\n", "[Server]\nworkers = 4\n"]
)
def test_unknown_section_is_config_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="unknown config section") as info:
        load_config(write_toml(tmp_path, text), env={})
    known = (
        "['auth', 'cluster', 'dram', 'hbm', 'integrity', 'keys', 'nvme', 'policy', 'redis', "
        "'router', 'server', 'shm', 'ucx']"
    )
    assert known in str(info.value)


def test_unknown_setting_in_file_names_it_and_the_known_ones(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[dram]\ncapacty = '1GiB'\n")
    with pytest.raises(ConfigError, match="unknown settings") as info:
        load_config(path, env={})
    assert "dram.capacty" in str(info.value)
    assert "'dram.capacity'" in str(info.value)


@pytest.mark.parametrize("name", ["dram.capacty", "workers", "server.workers.x", "redis.uri"])
def test_unknown_override_is_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown settings"):
        load_config(env={}, overrides={name: 1})


def test_redis_section_defaults_to_disabled_and_reads_file_env_and_flags(tmp_path: Path) -> None:
    assert load_config(env={}).redis.url == ""
    path = write_toml(tmp_path, "[redis]\nurl = 'redis://a:6379/0'\nttl_s = 60\n")
    config = load_config(
        path, env={"KVSTORE_REDIS_OP_TIMEOUT_S": "0.25"}, overrides={"redis.ttl_s": "30"}
    )
    assert (config.redis.url, config.redis.ttl_s, config.redis.op_timeout_s) == (
        "redis://a:6379/0",
        30.0,
        0.25,
    )
    assert config.redis.key_prefix == "kvstore:v1:"
    with pytest.raises(ConfigError, match=r"redis\.ttl_s"):
        load_config(env={}, overrides={"redis.ttl_s": 0})


# --- the shared-memory socket's mode --------------------------------------------------------------


def test_shm_socket_mode_defaults_to_owner_and_group() -> None:
    assert load_config(env={}).shm.socket_mode == 0o660


@pytest.mark.parametrize(
    ("text", "mode"),
    [("0660", 0o660), ("660", 0o660), ("0o600", 0o600), ("0666", 0o666), (" 640 ", 0o640)],
)
def test_shm_socket_mode_strings_are_octal(text: str, mode: int) -> None:
    assert load_config(env={"KVSTORE_SHM_SOCKET_MODE": text}).shm.socket_mode == mode
    overrides = {"shm.socket_mode": text}
    assert load_config(env={}, overrides=overrides).shm.socket_mode == mode


@pytest.mark.parametrize(
    ("toml", "mode"), [("0o640", 0o640), ('"0640"', 0o640), ('"600"', 0o600), ("416", 0o640)]
)
def test_shm_socket_mode_in_toml(tmp_path: Path, toml: str, mode: int) -> None:
    path = write_toml(tmp_path, f"[shm]\nsocket_mode = {toml}\n")
    assert load_config(path, env={}).shm.socket_mode == mode


def test_shm_socket_mode_flag_reaches_the_setting() -> None:
    from kvstore.cli import _parser
    from kvstore.cli.flags import flag_overrides

    args = _parser().parse_args(["serve", "--shm-socket-mode", "0600"])
    overrides = flag_overrides(args, args.setting_flags)
    assert overrides == {"shm.socket_mode": "0600"}
    assert load_config(env={}, overrides=overrides).shm.socket_mode == 0o600


@pytest.mark.parametrize("text", ["rw-rw----", "0888", "0x1b4", "", "6 6 0"])
def test_shm_socket_mode_that_is_not_octal_is_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match=r"shm\.socket_mode"):
        load_config(env={"KVSTORE_SHM_SOCKET_MODE": text})


@pytest.mark.parametrize("mode", [-1, 0o1000, 0o4755, 660])
def test_shm_socket_mode_must_be_permission_bits(mode: int) -> None:
    with pytest.raises(ConfigError, match=r"shm\.socket_mode must be permission bits"):
        ShmConfig(socket_mode=mode)


def test_decimal_shm_socket_mode_in_toml_is_refused_in_octal(tmp_path: Path) -> None:
    # TOML's 660 is decimal (0o1224): the error shows it in octal so the slip is visible.
    path = write_toml(tmp_path, "[shm]\nsocket_mode = 660\n")
    with pytest.raises(ConfigError, match="got 0o1224"):
        load_config(path, env={})
    assert ShmConfig(socket_mode=0).socket_mode == 0
    assert ShmConfig(socket_mode=0o777).socket_mode == 0o777


# --- invalid values -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "listen", ["localhost", "127.0.0.1", "localhost:", ":50051", "host:65536", "host:-1", "host:x"]
)
def test_listen_needs_host_and_port(listen: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ServerConfig(listen=listen)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_config(env={"KVSTORE_SERVER_LISTEN": listen})


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "localhost:65535", "[::]:50051", "unix-host:1"])
def test_valid_listen(listen: str) -> None:
    assert ServerConfig(listen=listen).listen == listen


@pytest.mark.parametrize("port", ["\u00b2", "\u0661\u0662\u0663"])
def test_listen_port_must_be_ascii_digits(port: str) -> None:
    with pytest.raises(ConfigError):
        ServerConfig(listen=f"h:{port}")


@pytest.mark.parametrize("page_size", [1000, 4095, 4097, 6144, 65536 + 512])
def test_page_size_must_be_multiple_of_4096(page_size: int) -> None:
    with pytest.raises(ConfigError, match="multiple of 4096"):
        DramConfig(capacity=0, page_size=page_size)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        load_config(env={}, overrides={"dram.page_size": page_size})


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"dram\.page_size"):
        DramConfig(capacity=0, page_size=0)


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"dram\.capacity"):
        DramConfig(capacity=-1)
    with pytest.raises(ConfigError):
        load_config(env={}, overrides={"dram.capacity": -1})
    with pytest.raises(ConfigError):
        load_config(env={"KVSTORE_DRAM_CAPACITY": "-1GiB"})


def test_zero_dram_capacity_disables_rather_than_fails() -> None:
    assert load_config(env={"KVSTORE_DRAM_CAPACITY": "0"}).dram.capacity == 0


def test_nvme_capacity_needs_a_mebibyte_only_when_enabled() -> None:
    with pytest.raises(ConfigError, match=r"nvme\.capacity"):
        NvmeConfig(path="/tmp/x", capacity=MiB - 1)
    assert NvmeConfig(path="/tmp/x", capacity=MiB).capacity == MiB
    assert NvmeConfig(path="", capacity=0).capacity == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"workers": 0}, "server.workers"),
        ({"max_block_bytes": 0}, "server.max_block_bytes"),
        ({"max_keys_per_request": -1}, "server.max_keys_per_request"),
        ({"shutdown_grace_s": -0.5}, "server.shutdown_grace_s"),
    ],
)
def test_server_limits_are_validated(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(name)):
        ServerConfig(**kwargs)


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"KVSTORE_SERVER_WORKERS": "many"}, "server.workers"),
        ({"KVSTORE_SERVER_WORKERS": "4.5"}, "server.workers"),
        ({"KVSTORE_SERVER_SHUTDOWN_GRACE_S": "soon"}, "server.shutdown_grace_s"),
    ],
)
def test_uncoercible_values_are_config_errors_naming_the_setting(
    env: dict[str, str], setting: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(setting)):
        load_config(env=env)


def test_bad_size_in_file_is_config_error(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[dram]\ncapacity = 'a lot'\n")
    with pytest.raises(ConfigError, match=UNITS_MESSAGE):
        load_config(path, env={})


def test_config_is_frozen() -> None:
    config = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server = ServerConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.workers = 1  # type: ignore[misc]
    assert isinstance(config, Config)


def test_a_boolean_shm_socket_mode_in_toml_is_refused(tmp_path: Path) -> None:
    """TOML's ``true`` is an int to Python: it must not become mode 0o001."""
    path = write_toml(tmp_path, "[shm]\nsocket_mode = true\n")
    with pytest.raises(ConfigError, match=r"shm\.socket_mode"):
        load_config(path, env={})


def test_inflight_budget_follows_dram_capacity_with_a_floor() -> None:
    assert load_config(env={}, overrides={"dram.capacity": "2GiB"}).server.inflight_bytes == (
        512 * MiB
    )
    # A small arena (or none) still leaves room for a few blocks in flight.
    assert load_config(env={"KVSTORE_DRAM_CAPACITY": "0"}).server.inflight_bytes == 64 * MiB
    env = {"KVSTORE_SERVER_INFLIGHT_BYTES": "16MiB", "KVSTORE_SERVER_PREFETCH_QUEUE_KEYS": "9"}
    server = load_config(env=env).server
    assert (server.inflight_bytes, server.prefetch_queue_keys) == (16 * MiB, 9)


@pytest.mark.parametrize("setting", ["server.inflight_bytes", "server.prefetch_queue_keys"])
def test_memory_bounds_must_be_positive(setting: str) -> None:
    with pytest.raises(ConfigError, match=f"{setting} must be > 0, got 0"):
        load_config(env={}, overrides={setting: 0})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KVSTORE_CLUSTER_ENABLED": "1"}, "cluster.url or redis.url"),
        ({"KVSTORE_CLUSTER_LEASE_TTL_S": "0"}, "cluster.lease_ttl_s"),
        ({"KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "20"}, "cluster.publish_interval_s"),
        ({"KVSTORE_CLUSTER_ADVERTISE": "fd00::5"}, "cluster.advertise must be HOST or HOST:PORT"),
        ({"KVSTORE_CLUSTER_ADVERTISE": "node-1:0"}, "cluster.advertise must name a port"),
        (
            {
                "KVSTORE_CLUSTER_ENABLED": "1",
                "KVSTORE_REDIS_URL": "redis://h:1/0",
                "KVSTORE_SERVER_LISTEN": "0.0.0.0:50051",
                "KVSTORE_AUTH_ALLOW_UNAUTHENTICATED": "1",
            },
            "set cluster.advertise",
        ),
    ],
)
def test_cluster_settings_are_checked(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        config_module.load_config(env=env)


def test_cluster_advertise_names_the_published_address() -> None:
    env = {
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_REDIS_URL": "redis://h:1/0",
        "KVSTORE_SERVER_LISTEN": "[::]:50051",
        "KVSTORE_CLUSTER_ADVERTISE": "10.0.0.5",
    }
    cluster = config_module.load_config(env=env).cluster
    assert cluster.grpc_target("[::]:50051") == "10.0.0.5:50051"
    assert config_module.load_config(env={}).cluster.grpc_target("h:1") == "h:1"
    with_port = config_module.load_config(env={**env, "KVSTORE_CLUSTER_ADVERTISE": "[fd00::5]:7"})
    assert with_port.cluster.grpc_target("[::]:50051") == "[fd00::5]:7"


def test_cluster_index_uses_the_redis_url_by_default() -> None:
    config = config_module.load_config(
        env={"KVSTORE_CLUSTER_ENABLED": "yes", "KVSTORE_REDIS_URL": "redis://h:1/0"}
    )
    assert config.cluster.enabled
    assert config.cluster.url == ""
    assert config.cluster.key_prefix == "kvstore:cluster:v1:"
