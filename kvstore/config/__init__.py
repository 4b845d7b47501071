"""Configuration: one frozen dataclass per section and one loader (:mod:`.loader`).

The package holds, each in the module of its concern::

    loader      Config, load_config: defaults < TOML file < environment < flags
    meta        the metadata every setting is declared with (help, kind, flag, old names)
    sizes       sizes with units (``64MiB``), parsed and printed
    machine     the defaults that depend on the machine (memory, home directory)
    server      [server]            data_plane  [shm], [ucx]        auth     [auth]
    store       [hbm] [dram] [nvme] [redis] [policy] [integrity]
    cluster     [cluster]           router      [router]            keys     [keys]
    tenants     [[tenants]]

``kvstore.config`` itself offers what the loader offers (the names below), as it did when it was
one module.
"""

from kvstore.config.keys import KeysConfig
from kvstore.config.loader import (
    OTHER_ENV_VARS,
    SHARED_DATA,
    SIZE_HINT,
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
    format_size,
    hash_secret,
    known_env_vars,
    load_config,
    machine_defaults,
    parse_size,
    setting_fields,
    setting_metas,
    setting_names,
    unknown_env_vars,
)
from kvstore.config.meta import SettingMeta
from kvstore.errors import ConfigError

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
