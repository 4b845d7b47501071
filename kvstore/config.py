"""Configuration: a few frozen dataclasses and one loader.

Every setting has one dotted name (``dram.capacity``), one environment variable
(``KVSTORE_DRAM_CAPACITY``) and, for the common ones, one ``kvstore serve`` flag
(``--dram-capacity``). :func:`load_config` merges, later winning::

    built-in defaults  <  TOML file (--config / KVSTORE_CONFIG)  <  environment  <  flags

Sizes accept plain bytes or ``KiB/MiB/GiB/TiB`` (and ``KB/MB/GB/TB``, decimal) suffixes.

The sections are plain frozen dataclasses, each in the module of its concern
(:mod:`kvstore.server_config`, :mod:`kvstore.store_config`, :mod:`kvstore.cluster_config`,
:mod:`kvstore.router_config`, :mod:`kvstore.tenant_config`) and all offered here; the defaults
that depend on the machine (``dram.capacity`` from its memory, ``nvme.path`` under its home
directory) come from :func:`machine_defaults`, and the loader is the only reader of environment
variables.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.cluster_config import SHARED_DATA, ClusterConfig, check_advertise
from kvstore.errors import ConfigError
from kvstore.keys_config import KeysConfig, with_aliases
from kvstore.machine_defaults import (
    available_memory,
    default_data_dir,
    default_dram_capacity,
    default_inflight_bytes,
    machine_defaults,
)
from kvstore.router_config import RouterConfig
from kvstore.server_config import ServerConfig
from kvstore.sizes import SIZE_HINT, format_size, parse_size
from kvstore.store_config import (
    DramConfig,
    HbmConfig,
    IntegrityConfig,
    NvmeConfig,
    PolicyConfig,
    RedisConfig,
)
from kvstore.tenant_config import TenantConfig, tenant_tables

#: Accepted values of ``cluster.shared_data`` (see :class:`ClusterConfig`).

__all__ = [
    "SHARED_DATA",
    "SIZE_HINT",
    "ClusterConfig",
    "Config",
    "DramConfig",
    "HbmConfig",
    "IntegrityConfig",
    "NvmeConfig",
    "PolicyConfig",
    "RedisConfig",
    "RouterConfig",
    "ServerConfig",
    "TenantConfig",
    "available_memory",
    "default_data_dir",
    "default_dram_capacity",
    "default_inflight_bytes",
    "format_size",
    "hash_secret",
    "load_config",
    "machine_defaults",
    "parse_size",
    "unknown_env_vars",
]


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration of one ``kvstore serve`` process.

    ``dram`` and ``nvme`` have no defaults here: theirs depend on the machine, and
    :func:`load_config` works them out (:func:`machine_defaults`).
    """

    server: ServerConfig = field(default_factory=ServerConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    dram: DramConfig
    nvme: NvmeConfig
    redis: RedisConfig = field(default_factory=RedisConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    keys: KeysConfig = field(default_factory=KeysConfig)
    #: Empty: one store that every caller shares, as before tenants existed.
    tenants: tuple[TenantConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.cluster.enabled and not (self.cluster.url or self.redis.url):
            raise ConfigError("cluster.enabled needs cluster.url or redis.url; both are empty")
        if self.cluster.shared_data != "redis" and not self.cluster.enabled:
            raise ConfigError(
                f"cluster.shared_data = {self.cluster.shared_data!r} needs cluster.enabled = true "
                "(peers are found through the cluster index)"
            )
        check_advertise(self.server.listen, self.cluster)


_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "hbm": HbmConfig,
    "dram": DramConfig,
    "nvme": NvmeConfig,
    "redis": RedisConfig,
    "policy": PolicyConfig,
    "integrity": IntegrityConfig,
    "cluster": ClusterConfig,
    "router": RouterConfig,
    "keys": KeysConfig,
}
_SIZE_SETTINGS = {
    "server.max_block_bytes",
    "server.inflight_bytes",
    "server.shm_session_bytes",
    "hbm.capacity",
    "hbm.page_size",
    "dram.capacity",
    "dram.page_size",
    "nvme.capacity",
    "redis.resend_queue_bytes",
    "router.max_body_bytes",
}
# Permission bits: strings ("0660", "660", "0o660") are octal; ints (TOML's 0o660) pass through.
_MODE_SETTINGS = {"server.shm_socket_mode"}
# Lists of names: comma-separated in the environment and on flags, a list or a string in TOML.
_LIST_SETTINGS = {"server.operators"}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
# Names from before every variable followed env_var(); any non-empty value meant "on".
_LEGACY_FLAGS = {"KVSTORE_FORCE_CUDA_CHECK": "dram.force_cuda_check"}


def setting_names() -> list[str]:
    """Every dotted setting name, e.g. ``dram.capacity``."""
    return [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in fields(cls)]


def env_var(setting: str) -> str:
    """The environment variable of a setting: ``dram.capacity`` → ``KVSTORE_DRAM_CAPACITY``."""
    return "KVSTORE_" + setting.replace(".", "_").upper()


def _coerce(setting: str, raw: Any, origin: str = "") -> Any:
    """``raw`` as the type of ``setting``; a ConfigError names the setting, where the value came
    from (``origin``: the file, the variable or the flag), the value and what is allowed."""
    try:
        return _convert(setting, raw)
    except (ConfigError, TypeError, ValueError) as exc:
        where = f" (from {origin})" if origin else ""
        if setting in _SIZE_SETTINGS:
            allowed = SIZE_HINT
        elif setting in _MODE_SETTINGS:
            allowed = 'octal permission bits, e.g. "0660"'
        else:
            allowed = str(exc)
        raise ConfigError(f"{setting}{where}: cannot use {raw!r}: {allowed}") from exc


def _convert(setting: str, raw: Any) -> Any:
    section, name = setting.split(".")
    kind = {f.name: f.type for f in fields(_SECTIONS[section])}[name]
    if setting in _SIZE_SETTINGS:
        return parse_size(raw if isinstance(raw, int) else str(raw))
    if setting in _MODE_SETTINGS:
        # type() and not isinstance(): a TOML bool is an int subclass, not permission bits.
        return raw if type(raw) is int else int(str(raw), 8)
    if setting in _LIST_SETTINGS and isinstance(raw, list):
        return ",".join(str(item).strip() for item in raw)
    if kind in ("bool", bool):
        return _boolean(raw)
    if kind in ("int", int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError("expected a whole number") from None
    if kind in ("float", float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError("expected a number") from None
    return str(raw)


def _boolean(raw: Any) -> bool:
    if type(raw) is bool:
        return raw
    text = str(raw).strip().lower()
    if text not in _TRUE | _FALSE:
        raise ValueError(f"expected one of {sorted(_TRUE)} or {sorted(_FALSE - {''})}")
    return text in _TRUE


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a :class:`Config` from defaults, a TOML file, the environment and flag overrides.

    ``env`` is the environment to read (``os.environ`` when ``None``); given one, nothing else
    of the process environment is read, the machine-dependent defaults included
    (:func:`machine_defaults`). ``overrides`` maps dotted setting names to values (``None``
    values are ignored), which is what the CLI passes for the flags it was given. Unknown names
    in the file or the overrides are an error that lists the known ones.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = machine_defaults(env)
    tenants: tuple[TenantConfig, ...] = ()
    origins: dict[str, str] = {}  # setting -> where its value came from, for error messages
    path = path if path is not None else env.get("KVSTORE_CONFIG") or None
    if path is not None:
        try:
            with open(path, "rb") as handle:
                document = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if "tenants" in document:
            tenants = tenant_tables(document.pop("tenants"))
        for section, values in document.items():
            if section not in _SECTIONS or not isinstance(values, dict):
                raise ConfigError(
                    f"unknown config section [{section}]; known: {sorted(_SECTIONS)} and tenants"
                )
            for name, value in values.items():
                merged[f"{section}.{name}"] = value
                origins[f"{section}.{name}"] = f"config file {path}"
    known = setting_names()
    for variable, setting in _LEGACY_FLAGS.items():
        if variable in env:
            merged[setting] = bool(env[variable])
    for setting in known:
        if env_var(setting) in env:
            merged[setting] = env[env_var(setting)]
            origins[setting] = env_var(setting)
    for setting, value in (overrides or {}).items():
        if value is not None:
            merged[setting] = value
            origins[setting] = "the command line"
    unknown = sorted(set(merged) - set(known))
    if unknown:
        hints = [
            f"{name} ({origins.get(name, '?')}){_did_you_mean(name, known)}" for name in unknown
        ]
        raise ConfigError(f"unknown settings: {'; '.join(hints)}; known: {known}")
    if "server.inflight_bytes" not in merged:
        # Resolved here, not in machine_defaults: it follows dram.capacity however that was set.
        dram = _coerce("dram.capacity", merged["dram.capacity"], origins.get("dram.capacity", ""))
        merged["server.inflight_bytes"] = default_inflight_bytes(dram)
    sections = {
        section: cls(
            **{
                s.split(".")[1]: _coerce(s, v, origins.get(s, ""))
                for s, v in merged.items()
                if s.startswith(section + ".")
            }
        )
        for section, cls in _SECTIONS.items()
    }
    sections["keys"] = with_aliases(sections["keys"], sections["cluster"])
    return Config(**sections, tenants=tenants)


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f", did you mean {close[0]}?" if close else ""


#: Every ``KVSTORE_*`` variable read outside :func:`load_config`'s settings: the config file,
#: clients (kvstore.client.settings), key derivation, and the test suites' switches.
OTHER_ENV_VARS = frozenset(
    {
        "KVSTORE_CONFIG",
        "KVSTORE_HASH_SECRET",
        "KVSTORE_TOKEN",
        "KVSTORE_TLS_CA",
        "KVSTORE_TARGET",
        "KVSTORE_DATA_PLANE",
        "KVSTORE_SHM_DIRECT_READS",
        "KVSTORE_SHM_PREFAULT",
        *_LEGACY_FLAGS,
        "KVSTORE_FUZZ_SEED",
        "KVSTORE_FUZZ_REQUESTS",
        "KVSTORE_SKIP_SLOW",
        "KVSTORE_SKIP_VLLM",
        "KVSTORE_SKIP_UCX",
        "KVSTORE_REQUIRE_VLLM",
        "KVSTORE_TIERS_MACHINE_EXAMPLES",
        "KVSTORE_VENV",
    }
)


def known_env_vars() -> list[str]:
    """Every ``KVSTORE_*`` environment variable anything in kvstore (or its tests) reads."""
    return sorted({env_var(s) for s in setting_names()} | OTHER_ENV_VARS)


def unknown_env_vars(env: Mapping[str, str]) -> list[str]:
    """One warning line per ``KVSTORE_*`` variable of ``env`` that nothing reads (a typo is
    otherwise silently ignored), naming the closest known one."""
    known = known_env_vars()
    return [
        f"unknown environment variable {name} ignored{_did_you_mean(name, known)}"
        for name in sorted(env)
        if name.startswith("KVSTORE_") and name not in known
    ]


#: Holds the secret chunk keys are derived with (:class:`kvstore.keys.ChunkHasher`).
HASH_SECRET_ENV = "KVSTORE_HASH_SECRET"


def hash_secret(env: Mapping[str, str] | None = None) -> str:
    """The key-derivation secret of processes that name chunks (the vLLM connector's default
    ``secret``): ``$KVSTORE_HASH_SECRET`` of ``env`` (the process environment if ``None``), empty
    when unset. Every replica sharing a store must use the same one."""
    return (os.environ if env is None else env).get(HASH_SECRET_ENV, "")
