"""Configuration: one frozen dataclass per section and one loader (:mod:`.loader`).

The package holds, each in the module of its concern::

    loader      Config, load_config: defaults < TOML file < environment < flags
    meta        the metadata every setting is declared with (help, kind, flag, old names)
    checks      how a section refuses a value (naming the setting and what it allows)
    sizes       sizes with units (``64MiB``), parsed and printed
    machine     the defaults that depend on the machine (memory, home directory)
    server      [server]            data_plane  [shm], [ucx]        auth     [auth]
    store       [hbm] [dram] [nvme] [redis] [policy] [integrity]
    cluster     [cluster]           router      [router]            keys     [keys]
    tenants     [[tenants]]

``kvstore.config`` itself offers what the loader offers (the names below), as it did when it was
one module, each loaded only when first asked for: a process that needs one fact (a connector
its hash secret, a client a size) loads that module, not every section.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.config.keys import KeysConfig
    from kvstore.config.loader import (
        OTHER_ENV_VARS,
        SHARED_DATA,
        AuthConfig,
        ClusterConfig,
        Config,
        DramConfig,
        HbmConfig,
        IntegrityConfig,
        NvmeConfig,
        PolicyConfig,
        RedisConfig,
        RouterConfig,
        ServerConfig,
        ShmConfig,
        TenantConfig,
        UcxConfig,
        available_memory,
        default_data_dir,
        default_dram_capacity,
        default_inflight_bytes,
        deprecated_names,
        env_var,
        known_env_vars,
        load_config,
        machine_defaults,
        setting_fields,
        setting_metas,
        setting_names,
        unknown_env_vars,
    )
    from kvstore.config.meta import SettingMeta
    from kvstore.config.sizes import (
        SIZE_HINT,
        format_size,
        parse_size,
    )
    from kvstore.errors import ConfigError
    from kvstore.key_scheme import hash_secret

__all__ = [
    "OTHER_ENV_VARS",
    "SHARED_DATA",
    "SIZE_HINT",
    "AuthConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DramConfig",
    "HbmConfig",
    "IntegrityConfig",
    "KeysConfig",
    "NvmeConfig",
    "PolicyConfig",
    "RedisConfig",
    "RouterConfig",
    "ServerConfig",
    "SettingMeta",
    "ShmConfig",
    "TenantConfig",
    "UcxConfig",
    "available_memory",
    "default_data_dir",
    "default_dram_capacity",
    "default_inflight_bytes",
    "deprecated_names",
    "env_var",
    "format_size",
    "hash_secret",
    "known_env_vars",
    "load_config",
    "machine_defaults",
    "parse_size",
    "setting_fields",
    "setting_metas",
    "setting_names",
    "unknown_env_vars",
]

#: Where each name lives: asking for it imports that module only.
_HOMES: dict[str, str] = {
    "KeysConfig": "kvstore.config.keys",
    "AuthConfig": "kvstore.config.loader",
    "ClusterConfig": "kvstore.config.loader",
    "Config": "kvstore.config.loader",
    "DramConfig": "kvstore.config.loader",
    "HbmConfig": "kvstore.config.loader",
    "IntegrityConfig": "kvstore.config.loader",
    "NvmeConfig": "kvstore.config.loader",
    "OTHER_ENV_VARS": "kvstore.config.loader",
    "PolicyConfig": "kvstore.config.loader",
    "RedisConfig": "kvstore.config.loader",
    "RouterConfig": "kvstore.config.loader",
    "SHARED_DATA": "kvstore.config.loader",
    "ServerConfig": "kvstore.config.loader",
    "ShmConfig": "kvstore.config.loader",
    "TenantConfig": "kvstore.config.loader",
    "UcxConfig": "kvstore.config.loader",
    "available_memory": "kvstore.config.loader",
    "default_data_dir": "kvstore.config.loader",
    "default_dram_capacity": "kvstore.config.loader",
    "default_inflight_bytes": "kvstore.config.loader",
    "deprecated_names": "kvstore.config.loader",
    "env_var": "kvstore.config.loader",
    "known_env_vars": "kvstore.config.loader",
    "load_config": "kvstore.config.loader",
    "machine_defaults": "kvstore.config.loader",
    "setting_fields": "kvstore.config.loader",
    "setting_metas": "kvstore.config.loader",
    "setting_names": "kvstore.config.loader",
    "unknown_env_vars": "kvstore.config.loader",
    "SettingMeta": "kvstore.config.meta",
    "SIZE_HINT": "kvstore.config.sizes",
    "format_size": "kvstore.config.sizes",
    "parse_size": "kvstore.config.sizes",
    "ConfigError": "kvstore.errors",
    "hash_secret": "kvstore.key_scheme",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvstore.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
