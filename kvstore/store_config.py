"""The settings of what the store is built from: its tiers (``[hbm]``, ``[dram]``, ``[nvme]``,
``[redis]``), how blocks are signed (``[integrity]``) and its placement and eviction rules
(``[policy]``). Plain frozen dataclasses that check their own values; :mod:`kvstore.config`
loads them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import ConfigError
from kvstore.policy import EVICTIONS, NVME_ADMISSIONS, SHARED_WRITES
from kvstore.retention import DEFAULT_MAX_RETENTION_S
from kvstore.sizes import format_size

__all__ = [
    "INTEGRITY_MACS",
    "DramConfig",
    "HbmConfig",
    "IntegrityConfig",
    "NvmeConfig",
    "PolicyConfig",
    "RedisConfig",
    "require_positive",
]


def require_positive(name: str, value: int) -> None:
    """Refuse (naming the setting) a count or size that must be above zero."""
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


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
        require_positive("hbm.page_size", self.page_size)
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
        require_positive("dram.page_size", self.page_size)
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
