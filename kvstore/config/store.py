"""The settings of what the store is built from: its tiers (``[hbm]``, ``[dram]``, ``[nvme]``,
``[redis]``), how blocks are signed (``[integrity]``) and its placement and eviction rules
(``[policy]``). Plain frozen dataclasses that check their own values; :mod:`kvstore.config`
loads them."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.checks import (
    check_choices,
    require_at_least,
    require_positive,
    require_seconds,
)
from kvstore.config.meta import setting
from kvstore.config.sizes import format_size
from kvstore.errors import ConfigError
from kvstore.policy import EVICTIONS, NVME_ADMISSIONS, SHARED_WRITES
from kvstore.retention import DEFAULT_MAX_RETENTION_S

__all__ = [
    "INTEGRITY_MACS",
    "DramConfig",
    "HbmConfig",
    "IntegrityConfig",
    "NvmeConfig",
    "PolicyConfig",
    "RedisConfig",
]


@dataclass(frozen=True)
class HbmConfig:
    """The accelerator-memory tier. ``capacity`` 0 (the default) disables it; it is built only
    where ``device`` exists (a CUDA device for ``cuda``)."""

    capacity: int = setting(
        0,
        help=(
            "accelerator-memory pool for hot blocks; `0` disables it; built only where the device "
            "exists"
        ),
        kind="size",
    )
    page_size: int = setting(
        1 * 1024**2,
        help="pool page",
        kind="size",
    )
    device: str = setting(
        "cuda",
        help="torch device of the pool",
    )
    promote_after_reads: int = setting(
        2,
        help=(
            "reads of a block (since it was stored) before it is promoted into `hbm`; below that a"
            " read promotes it only into `dram`, so a small pool does not churn on blocks read "
            "once; ≥ 1"
        ),
    )

    def __post_init__(self) -> None:
        require_at_least("hbm.capacity", self.capacity, 0, "0: no hbm tier")
        require_positive("hbm.page_size", self.page_size)
        require_at_least(
            "hbm.promote_after_reads",
            self.promote_after_reads,
            1,
            "reads before a block is promoted into hbm",
        )


@dataclass(frozen=True)
class DramConfig:
    """The host-memory arena. ``capacity`` 0 disables the tier (:func:`load_config` defaults it
    from the machine's memory). The arena is page-locked for CUDA where an NVIDIA driver is seen
    (``/dev/nvidiactl``); ``force_cuda_check`` asks torch even where that file is missing.
    ``verify_reads`` checks each block against its checksum on every read path (gRPC, shm
    leases, and a client's direct reads through the published index).
    ``prefault`` makes every arena page resident at start, as page-locking does, so that a
    block's first write into a page costs no page fault."""

    capacity: int = setting(
        help="host arena size; `0` disables the tier",
        kind="size",
        flag="--dram-capacity",
        default_doc="¼ of available memory, ≤ 16 GiB",
        metavar="SIZE",
    )
    page_size: int = setting(
        64 * 1024,
        help="arena page (multiple of 4 KiB)",
        kind="size",
        flag="--dram-page-size",
    )
    force_cuda_check: bool = setting(
        False,
        help=(
            "also ask torch for a CUDA device when `/dev/nvidiactl` is missing, to page-lock the "
            "arena (the older `KVSTORE_FORCE_CUDA_CHECK` is still read)"
        ),
    )
    verify_reads: bool = setting(
        False,
        help=(
            "check each block against the xxh3-64 checksum the server recorded at put (held in the"
            " server's memory) on every read path: gRPC gets and shm leases in the server, and a "
            "client's direct reads through the published index against a checksum the index then"
            " carries; a block that fails is a miss, dropped and counted in dram `corrupt_blocks`."
            " Clients cannot write the arena (it is sealed), so this guards against rot and server"
            ' bugs, not neighbours; off by default for its cost (BENCHMARKS.md, "Sealed arena")'
        ),
    )
    prefault: bool = setting(
        False,
        help=(
            "make every arena page resident at start (as page-locking for CUDA does), so the first"
            " write of a block into a page (a put, a promotion, a peer block received in place) "
            "costs no page fault; the whole `dram.capacity` is then in memory from the start"
        ),
    )

    def __post_init__(self) -> None:
        require_at_least("dram.capacity", self.capacity, 0, "0: no dram tier")
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

    path: str = setting(
        help="LMDB directory; `''` disables the tier",
        default_doc="`$XDG_DATA_HOME/kvstore/nvme`, else `~/.local/share/kvstore/nvme`",
        flag="--nvme-path",
        metavar="DIR",
    )
    capacity: int = setting(
        8 * 1024**3,
        help=(
            "LMDB map size: 80% holds blocks, 20% (at least 256 KiB) stays free for LMDB's own "
            "pages"
        ),
        kind="size",
        flag="--nvme-capacity",
    )

    def __post_init__(self) -> None:
        if self.path:
            require_at_least("nvme.capacity", self.capacity, 1024**2, "1MiB")


@dataclass(frozen=True)
class RedisConfig:
    """The shared ``redis`` tier. ``url`` empty disables it (``redis://``, ``redis+cluster://``)."""

    url: str = setting(
        "",
        help=(
            "shared tier: `redis://HOST:PORT/DB`, `rediss://`, `unix://` or "
            "`redis+cluster://HOST:PORT`; `''` disables it"
        ),
        flag="--redis-url",
        metavar="URL",
        short=(
            "shared redis tier, redis://HOST:PORT/DB or redis+cluster://HOST:PORT, '' turns it off"
        ),
    )
    ttl_s: float = setting(
        3600.0,
        help="seconds a block lives in Redis",
        flag="--redis-ttl",
        metavar="SECONDS",
    )
    op_timeout_s: float = setting(
        0.5,
        help=(
            "longest a request moving few bytes waits on Redis (the floor of every deadline); a "
            "request moving B bytes waits up to this + B / rate (see `redis.min_rate`), at most "
            "`redis.op_timeout_max_s`. Past its deadline the tier (with Redis Cluster: the master "
            "that did not answer) is marked down"
        ),
    )
    op_timeout_max_s: float = setting(
        30.0,
        help=(
            "longest any request waits on Redis, however many bytes it moves (the cap of every "
            "deadline); at least `redis.op_timeout_s`"
        ),
    )
    min_rate: int = setting(
        4 * 1024**2,
        help=(
            "bytes per second a request's deadline assumes the link moves at least: a request "
            "slower than this counts as an outage, unless this node measured the link slower, "
            "when half the measured rate is assumed instead (`rate_bytes_per_s` in the tier's "
            "stats). `8MiB` over the default 4 MiB/s: 0.5 + 2 s"
        ),
        kind="size",
    )
    max_connections: int = setting(
        4,
        help=(
            "connections this node keeps to each Redis server (each cluster primary), opened on "
            "its first call: also the most calls in flight to one server; more wait their turn "
            "within their deadline"
        ),
    )
    key_prefix: str = setting(
        "kvstore:v1:",
        help="prefix of every Redis key",
    )
    resend_queue_bytes: int = setting(
        256 * 1024**2,
        help=(
            "payload bytes of refused write-throughs kept to send again when Redis answers; past "
            "it a copy is not shared (counted)"
        ),
        kind="size",
    )
    resend_queue_blocks: int = setting(
        16384,
        help="the same bound in blocks; `0` for either keeps nothing",
    )

    def __post_init__(self) -> None:
        require_positive("redis.ttl_s", self.ttl_s)
        require_positive("redis.op_timeout_s", self.op_timeout_s)
        require_at_least(
            "redis.op_timeout_max_s", self.op_timeout_max_s, self.op_timeout_s, "redis.op_timeout_s"
        )
        require_positive("redis.min_rate", self.min_rate, "bytes per second, e.g. 4MiB")
        require_at_least("redis.max_connections", self.max_connections, 1, "1")
        for name in ("resend_queue_bytes", "resend_queue_blocks"):
            require_at_least(
                f"redis.{name}", getattr(self, name), 0, "0: never re-send a refused write-through"
            )


#: ``integrity.mac`` values, and the block header version each signs.
INTEGRITY_MACS = {"blake3": 3, "hmac-sha256": 2}


@dataclass(frozen=True)
class IntegrityConfig:
    """The secrets block MACs are keyed with (:mod:`kvstore.block`). ``secrets``: comma-separated,
    the first signs new blocks and all verify (rotation). Else ``secret_file``: a private file
    (mode 0600) of one secret per line, first signs. Both empty: ``integrity.key`` in the nvme
    directory, generated on first start; without nvme, a random secret per process. Every node
    sharing a Redis needs the same secrets. ``mac``: what new blocks are signed with, ``blake3``
    (header version 3) or ``hmac-sha256`` (version 2, what earlier versions wrote and read);
    either is verified."""

    secrets: str = setting(
        "",
        secret=True,
        help=(
            "comma-separated secrets that key block MACs: the first signs new blocks, all verify "
            "(rotation). Every node sharing a Redis needs the same ones: a node that shares none "
            "with the nodes already on its Redis says so at start and runs without the shared tier"
            " (see [How data flows](#how-data-flows))"
        ),
    )
    secret_file: str = setting(
        "",
        help=(
            "used when `integrity.secrets` is empty: a file of one secret per line (first signs), "
            "must exist and be mode 0600 or stricter. Both empty: `integrity.key` in the nvme "
            "directory, generated on first start; no nvme: a random secret per process (a warning "
            "when Redis is on)"
        ),
    )
    mac: str = setting(
        "blake3",
        help=(
            "what new blocks (to NVMe, Redis and peers) are signed with: `blake3` (keyed BLAKE3, "
            "header version 3) or `hmac-sha256` (header version 2, what versions before it wrote);"
            " both are always verified, here and by the previous release. Releases from before "
            "version 3 refuse version-3 blocks (and delete them from Redis): upgrading from one, "
            "set `hmac-sha256` on every node, then `blake3` once all are upgraded (see "
            "[docs/upgrades.md](docs/upgrades.md))"
        ),
        kind="choice",
        choices=tuple(INTEGRITY_MACS),
    )

    def __post_init__(self) -> None:
        if self.secrets and not all(part.strip() for part in self.secrets.split(",")):
            raise ConfigError("integrity.secrets must be non-empty secrets separated by commas")
        check_choices("integrity", self)


@dataclass(frozen=True)
class PolicyConfig:
    """Write and admission rules (see :mod:`kvstore.policy`): ``shared_write`` is ``through``
    or ``back``, ``nvme_admission`` is ``all`` or ``hit``; ``max_retention_s`` is the longest
    retention a put may ask for (:mod:`kvstore.retention`; a tenant's own replaces it)."""

    shared_write: str = setting(
        "through",
        help=(
            "`through`: new blocks go to Redis at once (in the background); `back`: only when they"
            " leave this node"
        ),
        kind="choice",
        choices=SHARED_WRITES,
    )
    nvme_admission: str = setting(
        "all",
        help=(
            "`all`: every block evicted from dram is demoted to nvme; `hit`: only blocks read at "
            "least once"
        ),
        kind="choice",
        choices=NVME_ADMISSIONS,
    )
    eviction: str = setting(
        "lru",
        help=(
            "which block leaves a full tier first: `lru` (least recently used), `fifo` (stored "
            "first), `lfu-aging` (read least often, with ageing so once-popular blocks leave too);"
            " hit rates on a shared-prefix trace in `BENCHMARKS.md`"
        ),
        kind="choice",
        choices=EVICTIONS,
    )
    max_retention_s: float = setting(
        DEFAULT_MAX_RETENTION_S,
        help=(
            "the longest retention a put may ask for, in seconds ([Prompt "
            "caching](#prompt-caching-retention-per-request)); a tenant's `max_retention_s` "
            "replaces it for that tenant"
        ),
    )

    def __post_init__(self) -> None:
        require_seconds("policy.max_retention_s", self.max_retention_s)
        check_choices("policy", self)
