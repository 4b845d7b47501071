"""Configuration: a few frozen dataclasses and one loader.

Every setting has one dotted name (``dram.capacity``), one environment variable
(``KVSTORE_DRAM_CAPACITY``) and, for the common ones, one ``kvstore serve`` flag
(``--dram-capacity``). :func:`load_config` merges, later winning::

    built-in defaults  <  TOML file (--config / KVSTORE_CONFIG)  <  environment  <  flags

Sizes accept plain bytes or ``KiB/MiB/GiB/TiB`` (and ``KB/MB/GB/TB``, decimal) suffixes.

The dataclasses are plain data; the defaults that depend on the machine (``dram.capacity`` from
its memory, ``nvme.path`` under its home directory) come from :func:`machine_defaults`, and the
loader is the only reader of environment variables.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.cluster_config import SHARED_DATA, ClusterConfig, check_advertise
from kvstore.errors import ConfigError
from kvstore.machine_defaults import (
    available_memory,
    default_data_dir,
    default_dram_capacity,
    default_inflight_bytes,
    machine_defaults,
)
from kvstore.policy import EVICTIONS, NVME_ADMISSIONS, SHARED_WRITES
from kvstore.retention import DEFAULT_MAX_RETENTION_S
from kvstore.router_config import RouterConfig
from kvstore.sizes import SIZE_HINT, format_size, parse_size
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


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC endpoint, request limits, ``workers`` threads for blocking disk I/O, and the
    shared-memory socket (``shm_socket``: a path, ``auto`` for one in the temp directory named
    after the process, or empty to turn the shared-memory data plane off) with its permission bits
    (``shm_socket_mode``, octal: a client must be able to write the socket to connect) and its
    bounds (connections in all and per peer uid, arena bytes one connection may hold leased or
    reserved, 0 meaning a quarter of ``dram.capacity``, seconds a frame may take to arrive), and the
    UCX listener for remote bulk transfers (``ucx_listen``: HOST:PORT, port 0 picks one; empty is
    off). ``inflight_bytes`` bounds the payload bytes all calls together hold at once (Put streams
    as they arrive, Get windows as they are read; :func:`load_config` defaults it to
    :func:`default_inflight_bytes` of ``dram.capacity``); ``prefetch_queue_keys`` bounds the keys
    of prefetches not yet finished, across all clients.

    Security (:mod:`kvstore.server.auth`): ``tls_cert``/``tls_key`` (PEM files) serve gRPC over
    TLS; ``tls_client_ca`` (PEM) then requires a client certificate signed by it;
    ``tokens_file`` names a file of ``NAME SHA256HEX`` lines (bearer tokens, stored hashed) that
    every call must match; ``allow_unauthenticated`` lets a server without either listen beyond
    loopback (``listen`` or any ``ucx_listen``). ``operators``: comma-separated identities (token
    names or certificate CNs) whose ``/metrics`` scrapes show every tenant's series; any other
    caller of a server with tenants sees its own tenant's only."""

    listen: str = "127.0.0.1:50051"
    max_block_bytes: int = 64 * 1024**2
    max_keys_per_request: int = 8192
    shutdown_grace_s: float = 5.0
    workers: int = 4
    shm_socket: str = "auto"
    shm_socket_mode: int = 0o660
    shm_max_connections: int = 256
    shm_max_connections_per_uid: int = 64
    shm_session_bytes: int = 0
    shm_frame_timeout_s: float = 10.0
    ucx_listen: str = ""
    #: Prometheus ``/metrics`` endpoint (HOST:PORT, port 0 picks one; empty is off).
    metrics_listen: str = "127.0.0.1:9464"
    ucx_transfer_timeout_s: float = 30.0
    put_stream_timeout_s: float = 60.0
    inflight_bytes: int = 256 * 1024**2
    prefetch_queue_keys: int = 65536
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    tokens_file: str = ""
    allow_unauthenticated: bool = False
    operators: str = ""

    @property
    def operator_identities(self) -> frozenset[str]:
        """The identities of ``operators``."""
        return frozenset(part.strip() for part in self.operators.split(",") if part.strip())

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("server.tls_cert and server.tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("server.tls_client_ca needs server.tls_cert and server.tls_key (TLS)")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
            raise ConfigError(
                f"server.listen must be HOST:PORT with a port from 0 to 65535 (0 picks a free "
                f"one), e.g. 127.0.0.1:50051, got {self.listen!r}"
            )
        host, sep, port = self.metrics_listen.rpartition(":")
        if self.metrics_listen and (
            not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535
        ):
            raise ConfigError(
                "server.metrics_listen must be HOST:PORT with a port from 0 to 65535 (0 picks a "
                f"free one), e.g. 127.0.0.1:9464, or '' for no metrics, got {self.metrics_listen!r}"
            )
        _positive("server.max_block_bytes", self.max_block_bytes)
        _positive("server.max_keys_per_request", self.max_keys_per_request)
        _positive("server.workers", self.workers)
        _positive("server.inflight_bytes", self.inflight_bytes)
        _positive("server.prefetch_queue_keys", self.prefetch_queue_keys)
        if not self.put_stream_timeout_s > 0:
            raise ConfigError(
                f"server.put_stream_timeout_s must be > 0, got {self.put_stream_timeout_s}"
            )
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"server.shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        _positive("server.shm_max_connections", self.shm_max_connections)
        _positive("server.shm_max_connections_per_uid", self.shm_max_connections_per_uid)
        if self.shm_session_bytes < 0:
            raise ConfigError(
                "server.shm_session_bytes must be >= 0 (0 = a quarter of dram.capacity), "
                f"got {self.shm_session_bytes}"
            )
        if not self.shm_frame_timeout_s > 0:
            raise ConfigError(
                f"server.shm_frame_timeout_s must be > 0, got {self.shm_frame_timeout_s}"
            )
        if not 0 <= self.shm_socket_mode <= 0o777:
            # Shown in octal: a decimal 660 in TOML (not 0o660) lands here as 0o1224.
            raise ConfigError(
                "server.shm_socket_mode must be permission bits from 0o000 to 0o777 "
                f'(0o660 in TOML, "0660" elsewhere), got {oct(self.shm_socket_mode)}'
            )


@dataclass(frozen=True)
class HbmConfig:
    """The accelerator-memory tier. ``capacity`` 0 (the default) disables it; it is built only
    where ``device`` exists (a CUDA device for ``cuda``)."""

    capacity: int = 0
    page_size: int = 1024**2
    device: str = "cuda"
    #: Reads (since it was stored) before a block is promoted into the pool: a small pool then
    #: holds what engines reuse instead of churning on blocks read once (:mod:`kvstore.policy`).
    promote_after_reads: int = 2

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ConfigError(f"hbm.capacity must be >= 0, got {self.capacity}")
        _positive("hbm.page_size", self.page_size)
        if self.promote_after_reads < 1:
            raise ConfigError(
                "hbm.promote_after_reads must be a whole number >= 1 (reads before a block is "
                f"promoted into hbm), got {self.promote_after_reads}"
            )


@dataclass(frozen=True)
class DramConfig:
    """The host-memory arena. ``capacity`` 0 disables the tier (:func:`load_config` defaults it
    from the machine's memory). The arena is page-locked for CUDA where an NVIDIA driver is seen
    (``/dev/nvidiactl``); ``force_cuda_check`` asks torch even where that file is missing.
    ``verify_reads`` checks each block's MAC before the server serves it from DRAM (gRPC and
    shm leases; a client's direct reads through the published index are not checked).
    ``prefault`` makes every arena page resident at start, as page-locking does, so that a
    block's first write into a page costs no page fault."""

    capacity: int
    page_size: int = 64 * 1024
    force_cuda_check: bool = False
    verify_reads: bool = False
    prefault: bool = False

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ConfigError(f"dram.capacity must be >= 0, got {self.capacity}")
        _positive("dram.page_size", self.page_size)
        if self.page_size % 4096:
            raise ConfigError(f"dram.page_size must be a multiple of 4096, got {self.page_size}")
        if 0 < self.capacity < self.page_size:
            raise ConfigError(
                f"dram.capacity={self.capacity} B is smaller than one page (dram.page_size="
                f"{format_size(self.page_size)}): give at least {self.page_size // 1024}KiB, "
                "or 0 to turn the dram tier off"
            )


@dataclass(frozen=True)
class NvmeConfig:
    """The LMDB tier. ``path`` empty disables the tier (:func:`load_config` defaults it to
    ``nvme`` under :func:`default_data_dir`)."""

    path: str
    capacity: int = 8 * 1024**3

    def __post_init__(self) -> None:
        if self.path and self.capacity < 1024**2:
            raise ConfigError(f"nvme.capacity must be at least 1MiB, got {self.capacity}")


@dataclass(frozen=True)
class RedisConfig:
    """The shared ``redis`` tier. ``url`` empty disables it (``redis://``, ``redis+cluster://``)."""

    url: str = ""
    ttl_s: float = 3600.0
    op_timeout_s: float = 0.5
    key_prefix: str = "kvstore:v1:"
    #: Write-throughs Redis refused (down, failover) kept to send again: bytes and blocks.
    resend_queue_bytes: int = 256 * 1024**2
    resend_queue_blocks: int = 16384

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ConfigError(f"redis.ttl_s must be > 0, got {self.ttl_s}")
        if self.op_timeout_s <= 0:
            raise ConfigError(f"redis.op_timeout_s must be > 0, got {self.op_timeout_s}")
        for name in ("resend_queue_bytes", "resend_queue_blocks"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"redis.{name} must be >= 0 (0: never re-send a refused write-through), "
                    f"got {getattr(self, name)}"
                )


@dataclass(frozen=True)
class IntegrityConfig:
    """The secrets block MACs are keyed with (:mod:`kvstore.block`). ``secrets``: comma-separated,
    the first signs new blocks and all verify (rotation). Else ``secret_file``: a private file
    (mode 0600) of one secret per line, first signs. Both empty: ``integrity.key`` in the nvme
    directory, generated on first start; without nvme, a random secret per process. Every node
    sharing a Redis needs the same secrets. ``mac``: what new blocks are signed with, ``blake3``
    (header version 3) or ``hmac-sha256`` (version 2, what earlier versions wrote and read);
    either is verified."""

    secrets: str = field(default="", repr=False)
    secret_file: str = ""
    mac: str = "blake3"

    def __post_init__(self) -> None:
        if self.secrets and not all(part.strip() for part in self.secrets.split(",")):
            raise ConfigError("integrity.secrets must be non-empty secrets separated by commas")
        if self.mac not in INTEGRITY_MACS:
            allowed = ", ".join(INTEGRITY_MACS)
            raise ConfigError(f"integrity.mac must be one of {allowed}, got {self.mac!r}")


#: ``integrity.mac`` values, and the block header version each signs.
INTEGRITY_MACS = {"blake3": 3, "hmac-sha256": 2}


@dataclass(frozen=True)
class PolicyConfig:
    """Write and admission rules (see :mod:`kvstore.policy`): ``shared_write`` is ``through``
    or ``back``, ``nvme_admission`` is ``all`` or ``hit``; ``max_retention_s`` is the longest
    retention a put may ask for (:mod:`kvstore.retention`; a tenant's own replaces it)."""

    shared_write: str = "through"
    nvme_admission: str = "all"
    eviction: str = "lru"
    max_retention_s: float = DEFAULT_MAX_RETENTION_S

    def __post_init__(self) -> None:
        if not 0 <= self.max_retention_s < float("inf"):
            raise ConfigError(
                f"policy.max_retention_s must be a number of seconds >= 0, "
                f"got {self.max_retention_s!r}"
            )
        if self.shared_write not in SHARED_WRITES:
            raise ConfigError(
                f"policy.shared_write must be one of {list(SHARED_WRITES)}, "
                f"got {self.shared_write!r}"
            )
        if self.nvme_admission not in NVME_ADMISSIONS:
            raise ConfigError(
                f"policy.nvme_admission must be one of {list(NVME_ADMISSIONS)}, "
                f"got {self.nvme_admission!r}"
            )
        if self.eviction not in EVICTIONS:
            raise ConfigError(
                f"policy.eviction must be one of {list(EVICTIONS)}, got {self.eviction!r}"
            )


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


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


#: Holds the secret chunk keys are derived with (:class:`kvstore.keys.ChunkHasher`).
HASH_SECRET_ENV = "KVSTORE_HASH_SECRET"


def hash_secret(env: Mapping[str, str] | None = None) -> str:
    """The key-derivation secret of processes that name chunks (the vLLM connector's default
    ``secret``): ``$KVSTORE_HASH_SECRET`` of ``env`` (the process environment if ``None``), empty
    when unset. Every replica sharing a store must use the same one."""
    return (os.environ if env is None else env).get(HASH_SECRET_ENV, "")
