"""Configuration: a few frozen dataclasses and one loader.

Every setting has one dotted name (``dram.capacity``), one environment variable
(``KVSTORE_DRAM_CAPACITY``) and, for the common ones, one ``kvstore serve`` flag
(``--dram-capacity``). :func:`load_config` merges, later winning::

    built-in defaults  <  TOML file (--config / KVSTORE_CONFIG)  <  environment  <  flags

Sizes accept plain bytes or ``KiB/MiB/GiB/TiB`` (and ``KB/MB/GB/TB``, decimal) suffixes.

The sections are plain frozen dataclasses, each in the module of its concern
(:mod:`kvstore.config.server`, :mod:`kvstore.config.data_plane` for ``[shm]`` and ``[ucx]``,
:mod:`kvstore.config.auth`, :mod:`kvstore.config.store`, :mod:`kvstore.config.cluster`,
:mod:`kvstore.config.router`, :mod:`kvstore.config.tenants`) and all offered here; the defaults
that depend on the machine (``dram.capacity`` from its memory, ``nvme.path`` under its home
directory) come from :func:`machine_defaults`, and the loader is the only reader of environment
variables.

Each field says what it is once, in its metadata (:func:`kvstore.config.meta.setting`): help, kind
(size, octal mode, list, choice), flag, and the names it had before. The loader takes its kinds from
there, ``kvstore serve`` / ``kvstore router`` their flags (:mod:`kvstore.cli.flags`) and
docs/configuration.md its settings table (``scripts/gen_settings_table.py``). A setting's old name
(in the file, as a variable or as an override) still sets it for one release, with one warning line
naming the new one.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

from kvstore.config.auth import AuthConfig
from kvstore.config.cluster import SHARED_DATA, ClusterConfig, check_advertise
from kvstore.config.data_plane import ShmConfig, UcxConfig
from kvstore.config.keys import KeysConfig, with_aliases
from kvstore.config.machine import (
    available_memory,
    default_data_dir,
    default_dram_capacity,
    default_inflight_bytes,
    machine_defaults,
)
from kvstore.config.meta import SettingMeta, meta_of
from kvstore.config.router import RouterConfig
from kvstore.config.server import ServerConfig
from kvstore.config.sizes import SIZE_HINT, format_size, parse_size
from kvstore.config.store import (
    DramConfig,
    HbmConfig,
    IntegrityConfig,
    NvmeConfig,
    PolicyConfig,
    RedisConfig,
)
from kvstore.config.tenants import TenantConfig, tenant_tables
from kvstore.deprecation import deprecated
from kvstore.errors import ConfigError
from kvstore.key_scheme import hash_secret

__all__ = [
    "SHARED_DATA",
    "SIZE_HINT",
    "AuthConfig",
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
    "ShmConfig",
    "TenantConfig",
    "UcxConfig",
    "available_memory",
    "default_data_dir",
    "default_dram_capacity",
    "default_inflight_bytes",
    "format_size",
    "hash_secret",
    "load_config",
    "machine_defaults",
    "parse_size",
    "setting_metas",
    "unknown_env_vars",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration of one ``kvstore serve`` process.

    ``dram`` and ``nvme`` have no defaults here: theirs depend on the machine, and
    :func:`load_config` works them out (:func:`machine_defaults`).
    """

    server: ServerConfig = field(default_factory=ServerConfig)
    shm: ShmConfig = field(default_factory=ShmConfig)
    ucx: UcxConfig = field(default_factory=UcxConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
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


#: Every section in the order the settings table and ``kvstore serve --help`` show them.
_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "shm": ShmConfig,
    "ucx": UcxConfig,
    "auth": AuthConfig,
    "hbm": HbmConfig,
    "dram": DramConfig,
    "nvme": NvmeConfig,
    "redis": RedisConfig,
    "integrity": IntegrityConfig,
    "policy": PolicyConfig,
    "cluster": ClusterConfig,
    "keys": KeysConfig,
    "router": RouterConfig,
}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
# Names from before every variable followed env_var(); any non-empty value meant "on".
_LEGACY_FLAGS = {"KVSTORE_FORCE_CUDA_CHECK": "dram.force_cuda_check"}


def setting_fields() -> dict[str, Field[Any]]:
    """Every setting's dataclass field by dotted name, sections in :data:`_SECTIONS` order."""
    return {f"{s}.{f.name}": f for s, cls in _SECTIONS.items() for f in fields(cls)}


def setting_metas() -> dict[str, SettingMeta]:
    """Every setting's :class:`~kvstore.config.meta.SettingMeta` by dotted name: the one source
    of the loader's kinds, the flags and the settings table."""
    return {name: meta_of(f) for name, f in setting_fields().items()}


def setting_names() -> list[str]:
    """Every dotted setting name, e.g. ``dram.capacity``."""
    return list(setting_fields())


def deprecated_names() -> dict[str, str]:
    """Old dotted names still read (for one release, with a warning) and the name of each now."""
    return {old: name for name, meta in setting_metas().items() for old in meta.old_names}


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
        kind = setting_metas()[setting].kind
        if kind == "size":
            allowed = SIZE_HINT
        elif kind == "mode":
            allowed = 'octal permission bits, e.g. "0660"'
        else:
            allowed = str(exc)
        raise ConfigError(f"{setting}{where}: cannot use {raw!r}: {allowed}") from exc


def _convert(setting: str, raw: Any) -> Any:
    spec = setting_fields()[setting]
    kind, meta = spec.type, meta_of(spec)
    if meta.kind == "size":
        return parse_size(raw if isinstance(raw, int) else str(raw))
    if meta.kind == "mode":
        # type() and not isinstance(): a TOML bool is an int subclass, not permission bits.
        return raw if type(raw) is int else int(str(raw), 8)
    if meta.kind == "list" and isinstance(raw, list):
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
        tenants = _merge_file(merged, origins, path)
    known = setting_names()
    for variable, setting in _LEGACY_FLAGS.items():
        if variable in env:
            logger.warning("%s", deprecated(variable, f"set {env_var(setting)} instead"))
            merged[setting] = bool(env[variable])
    from_env = {s: env[env_var(s)] for s in [*deprecated_names(), *known] if env_var(s) in env}
    _merge(merged, origins, from_env, "", _deprecated_variable)
    from_flags = {s: v for s, v in (overrides or {}).items() if v is not None}
    _merge(merged, origins, from_flags, "the command line", lambda old, new: (old, new))
    unknown = sorted(set(merged) - set(known))
    if unknown:
        hints = [
            f"{name} ({origins.get(name, '?')}){_did_you_mean(name, known)}" for name in unknown
        ]
        raise ConfigError(f"unknown settings: {'; '.join(hints)}; known: {known}")
    return _build(merged, origins, tenants)


def _merge_file(
    merged: dict[str, Any], origins: dict[str, str], path: str | os.PathLike[str]
) -> tuple[TenantConfig, ...]:
    """Merge the settings of the TOML file at ``path`` into ``merged``; its tenants' tables."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    tenants: tuple[TenantConfig, ...] = ()
    if "tenants" in document:
        tenants = tenant_tables(document.pop("tenants"))
    for section, values in document.items():
        if section not in _SECTIONS or not isinstance(values, dict):
            raise ConfigError(
                f"unknown config section [{section}]; known: {sorted(_SECTIONS)} and tenants"
            )
        layer = {f"{section}.{name}": value for name, value in values.items()}
        _merge(merged, origins, layer, f"config file {path}", _deprecated_in_file(path))
    return tenants


def _build(
    merged: dict[str, Any], origins: dict[str, str], tenants: tuple[TenantConfig, ...]
) -> Config:
    """The :class:`Config` of the merged settings (every name known), each coerced to its type
    (a refusal names where its value came from, ``origins``)."""
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


def _merge(
    merged: dict[str, Any],
    origins: dict[str, str],
    layer: Mapping[str, Any],
    origin: str,
    renamed: Callable[[str, str], tuple[str, str]],
) -> None:
    """Lay ``layer`` (one source: the file, the environment or the flags) over ``merged``. An old
    name counts as its new one, with one warning line (``renamed(old, new)``: how the source spells
    each); where a layer gives both, the new name wins. ``origin`` "" means the environment,
    whose origin is each variable's name."""
    aliases = deprecated_names()
    for setting, value in layer.items():
        if setting in aliases:
            old, new = renamed(setting, aliases[setting])
            logger.warning("%s", deprecated(old, f"use {new}"))
            if aliases[setting] in layer:
                continue
        name = aliases.get(setting, setting)
        merged[name] = value
        origins[name] = origin or env_var(setting)


def _deprecated_in_file(
    path: str | os.PathLike[str],
) -> Callable[[str, str], tuple[str, str]]:
    def renamed(old: str, new: str) -> tuple[str, str]:
        section, name = old.split(".")
        new_section, new_name = new.split(".")
        return f"[{section}] {name} in {path}", f"[{new_section}] {new_name}"

    return renamed


def _deprecated_variable(old: str, new: str) -> tuple[str, str]:
    return env_var(old), env_var(new)


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
    """Every ``KVSTORE_*`` environment variable anything in kvstore (or its tests) reads (the
    deprecated names of settings included: they are read, with a warning)."""
    names = [*setting_names(), *deprecated_names()]
    return sorted({env_var(s) for s in names} | OTHER_ENV_VARS)


def unknown_env_vars(env: Mapping[str, str]) -> list[str]:
    """One warning line per ``KVSTORE_*`` variable of ``env`` that nothing reads (a typo is
    otherwise silently ignored), naming the closest known one."""
    known = known_env_vars()
    return [
        f"unknown environment variable {name} ignored{_did_you_mean(name, known)}"
        for name in sorted(env)
        if name.startswith("KVSTORE_") and name not in known
    ]
