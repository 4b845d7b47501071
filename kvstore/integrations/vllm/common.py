"""What both halves of the vLLM connector share: settings, the step plan, namespaces, a breaker.

The scheduler half (:mod:`kvstore.integrations.vllm.scheduler`) decides, and the worker half
(:mod:`kvstore.integrations.vllm.worker`) moves bytes; the only thing that travels between them is
one :class:`StepPlan` per engine step, so everything in it is plain picklable data.

Nothing here imports vLLM (its configuration objects are only read, duck-typed), so this logic is
tested without it; :mod:`kvstore.integrations.vllm` wraps the plan in vLLM's metadata type.

A stored value is one *chunk*: ``chunk_size`` tokens of every layer, laid out as the gather kernel
writes it, ``[num_layers, chunk_size // block_size, *block_shape]``, where a block is one slice of
the engine's per-layer paged cache along its block dimension, copied whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.client import KVStoreClient
from kvstore.config import hash_secret
from kvstore.errors import (
    ConfigError,
)
from kvstore.integrations.breaker import Breaker, warm_up
from kvstore.integrations.paged.groups import GroupSpec, groups_fingerprint
from kvstore.integrations.paged.plan import LoadSpec, SaveSpec
from kvstore.key_scheme import DEFAULT_CHUNK_SIZE
from kvstore.keys import ChunkHasher, HashAlgorithm, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "LOAD_POLICIES",
    "Breaker",
    "ConnectorSettings",
    "EngineShape",
    "LoadSpec",
    "SaveSpec",
    "StepPlan",
    "engine_groups",
    "engine_shape",
    "make_hasher",
    "rank_keys",
    "warm_up",
]

logger = logging.getLogger(__name__)

_RANK_TAG = b"kvstore-rank-key-v1\x00"

_KNOWN_KEYS = frozenset(
    {
        "target",
        "chunk_size",
        "tenant",
        "timeout_s",
        "lookup_timeout_s",
        "retry_after_s",
        "hash_algorithm",
        "secret",
        "token",
        "tls_ca",
        "handoff_wait_s",
        "load_policy",
    }
)
#: ``load_policy`` values: ``cost`` loads only the leading stored chunks that load faster than
#: the engine computes them (:mod:`kvstore.client.cost_model`); ``always`` loads every hit (the
#: connector before the cost model); ``never`` loads nothing (a baseline for benchmarks).
LOAD_POLICIES = ("cost", "always", "never")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's part of ``kv_connector_extra_config``.

    Attributes:
        target: ``HOST:PORT`` of the ``kvstore serve`` process.
        chunk_size: Tokens per stored chunk; a multiple of the engine's block size. The store's
            (its node's ``keys.chunk_size``) unless in ``pinned``; see
            :mod:`kvstore.integrations.vllm.scheme`.
        tenant: Isolates one tenant's blocks from another's (part of the namespace).
        timeout_s: Deadline of each get and put.
        lookup_timeout_s: Deadline of a scheduler lookup. A request waits at most this long for
            its answer (the scheduler keeps running other requests meanwhile); after it, the
            request goes ahead as a miss.
        retry_after_s: After the store fails a call, how long to treat it as down (answer
            misses, skip saves) before trying it again (an unreachable store: or until its
            connection comes back, whichever is first); after a lookup outlives
            ``lookup_timeout_s``, how long lookups answer misses (saves go on).
        hash_algorithm: ``"xxh3_128"`` or ``"sha256"``; the store's unless in ``pinned``.
        secret: Key-derivation secret; defaults to the ``KVSTORE_HASH_SECRET`` environment
            variable (:func:`kvstore.config.hash_secret`). Every replica sharing a store must
            use the same one.
        token: Bearer token for a server with ``auth.tokens_file``; ``None`` leaves it to
            the client (``KVSTORE_TOKEN``).
        tls_ca: PEM file of the server's CA (TLS); ``None`` leaves it to the client
            (``KVSTORE_TLS_CA``).
        handoff_wait_s: Prefill/decode hand-off: how long a request that carries a producer's
            saved-chunk count waits for those chunks to reach the store (the producer's puts
            are asynchronous) before it goes ahead with the ones that arrived.
        load_policy: Which stored chunks to load (:data:`LOAD_POLICIES`): ``cost`` (the
            default) those that load faster than the engine recomputes them, ``always`` every
            hit, ``never`` none.
        pinned: Which of ``chunk_size`` and ``hash_algorithm`` the connector's config set: the
            store must agree with them (the others are taken from the store).
    """

    target: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    tenant: str = ""
    timeout_s: float = 5.0
    lookup_timeout_s: float = 0.5
    retry_after_s: float = 5.0
    hash_algorithm: HashAlgorithm = "xxh3_128"
    secret: str = ""
    token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    handoff_wait_s: float = 2.0
    load_policy: str = "cost"
    pinned: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.load_policy not in LOAD_POLICIES:
            raise ConfigError(
                f"load_policy: cannot use {self.load_policy!r}: one of {', '.join(LOAD_POLICIES)}"
            )
        if not self.target or ":" not in self.target:
            raise ConfigError(f"target must be 'HOST:PORT', got {self.target!r}")
        if self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        for name in ("timeout_s", "lookup_timeout_s", "handoff_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_after_s < 0:
            raise ConfigError(f"retry_after_s must be >= 0, got {self.retry_after_s}")

    @classmethod
    def from_extra_config(
        cls, extra: dict[str, Any], env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Read and validate the settings; unknown keys are an error (they are usually typos).

        ``env`` is where a missing ``secret`` is looked up (the process environment if ``None``).
        """
        unknown = set(extra) - _KNOWN_KEYS
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                f"allowed: {sorted(_KNOWN_KEYS)}"
            )
        if "target" not in extra:
            raise ConfigError("kv_connector_extra_config needs 'target': 'HOST:PORT'")
        try:
            return cls(
                target=str(extra["target"]),
                chunk_size=int(extra.get("chunk_size", DEFAULT_CHUNK_SIZE)),
                tenant=str(extra.get("tenant", "")),
                timeout_s=float(extra.get("timeout_s", 5.0)),
                lookup_timeout_s=float(extra.get("lookup_timeout_s", 0.5)),
                retry_after_s=float(extra.get("retry_after_s", 5.0)),
                hash_algorithm=extra.get("hash_algorithm", "xxh3_128"),
                secret=str(extra["secret"]) if "secret" in extra else hash_secret(env),
                token=str(extra["token"]) if "token" in extra else None,
                tls_ca=str(extra["tls_ca"]) if "tls_ca" in extra else None,
                handoff_wait_s=float(extra.get("handoff_wait_s", 2.0)),
                load_policy=str(extra.get("load_policy", "cost")),
                pinned=frozenset({"chunk_size", "hash_algorithm"} & set(extra)),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad kv_connector_extra_config value: {exc}") from exc

    def open_client(self, namespace: Namespace) -> KVStoreClient:
        """A client of the configured store under ``namespace``, with these credentials."""
        return KVStoreClient(
            self.target,
            namespace=namespace,
            timeout=self.timeout_s,
            token=self.token,
            tls_ca=self.tls_ca,
        )


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What the engine's configuration says about its paged KV cache."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layout: str
    tp_size: int
    pp_rank: int
    pp_size: int
    #: :func:`~kvstore.integrations.paged.groups.groups_fingerprint` of a hybrid engine's
    #: groups ("" for one group: its namespace is the one engines had before groups).
    groups: str = ""


def check_whole_blocks(chunk_size: int, block_size: int, what: str = "chunk_size") -> None:
    """Refuse a chunk size (``what`` says whose) that is not a whole number of engine blocks."""
    if chunk_size % block_size:
        raise ConfigError(
            f"{what} {chunk_size} must be a multiple of the engine's block size {block_size}"
        )


def blocks_per_chunk(settings: ConnectorSettings, shape: EngineShape) -> int:
    """Engine blocks in one stored chunk; the chunk size must be a whole number of blocks."""
    check_whole_blocks(settings.chunk_size, shape.block_size)
    return settings.chunk_size // shape.block_size


def engine_groups(kv_cache_config: KVCacheConfig) -> list[GroupSpec]:
    """The engine's KV cache groups, each a :class:`~kvstore.integrations.paged.groups.GroupSpec`.

    The kind is read from the spec's type (duck-typed: vLLM is not imported): ``SlidingWindow*``
    is ``sliding`` (window: ``sliding_window`` plus any ``extra_retained_tokens`` vLLM keeps),
    ``ChunkedLocalAttentionSpec`` ``local``, ``MambaSpec`` ``state``, ``UniformTypeKVCacheSpecs``
    (layers of several page sizes in one group) ``mixed``; any other spec with attention's
    fields is ``full`` (with the hybrid manager off vLLM makes every layer full attention), and
    the rest (cross or encoder-only attention, draft-model and non-transferable groups)
    ``other``.
    """
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec: Any = group.kv_cache_spec
        kind, window = _group_kind(group, spec)
        try:
            page = int(spec.page_size_bytes)
        except Exception:  # a duck-typed stand-in without it: the fields below still name it
            page = 0
        detail = "/".join(
            f"{name}={getattr(spec, name)}"
            for name in ("num_kv_heads", "head_size", "head_size_v", "dtype", "shapes", "dtypes")
            if hasattr(spec, name)
        )
        groups.append(
            GroupSpec(
                index=index,
                kind=kind,
                block_size=int(spec.block_size),
                window=window,
                layers=tuple(group.layer_names),
                page_bytes=page,
                detail=f"{type(spec).__name__}/{detail}",
            )
        )
    return groups


def _group_kind(group: Any, spec: Any) -> tuple[str, int]:
    name = type(spec).__name__
    if getattr(group, "is_eagle_group", False) or not getattr(group, "enable_kv_transfer", True):
        return "other", 0
    if hasattr(spec, "kv_cache_specs"):
        return "mixed", 0
    if name.startswith("Mamba") or hasattr(spec, "shapes"):
        return "state", 0
    if name.startswith("SlidingWindow"):
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return "sliding", int(spec.sliding_window) + extra
    if name == "ChunkedLocalAttentionSpec":
        return "local", int(spec.attention_chunk_size)
    if name in ("CrossAttentionSpec", "EncoderOnlyAttentionSpec"):
        return "other", 0
    if all(hasattr(spec, f) for f in ("num_kv_heads", "head_size", "dtype", "block_size")):
        return "full", 0
    return "other", 0


def engine_shape(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, pp_rank: int, group: int = 0
) -> EngineShape:
    """Describe group ``group`` of the engine's KV cache (the same on both halves).

    ``num_layers`` counts every group's layers. A group without attention's fields (recurrent
    state) gets 0 heads and head size: such an engine's connector stores nothing.
    """
    groups = kv_cache_config.kv_cache_groups
    # Only attention specs have these fields; the base type lacks them.
    spec: Any = groups[group].kv_cache_spec
    parallel = vllm_config.parallel_config
    attention = all(hasattr(spec, f) for f in ("num_kv_heads", "head_size", "dtype"))
    dtypes = getattr(spec, "dtypes", None) or ("unknown",)
    return EngineShape(
        block_size=int(spec.block_size),
        num_layers=sum(len(g.layer_names) for g in groups),
        num_kv_heads=int(spec.num_kv_heads) if attention else 0,
        head_size=int(spec.head_size) if attention else 0,
        dtype=str(spec.dtype if attention else dtypes[0]).removeprefix("torch."),
        layout=_cache_layout(vllm_config, spec) if attention else "state",
        tp_size=int(parallel.tensor_parallel_size),
        pp_rank=pp_rank,
        pp_size=int(parallel.pipeline_parallel_size),
        groups=groups_fingerprint(engine_groups(kv_cache_config)) if len(groups) > 1 else "",
    )


def _cache_layout(vllm_config: VllmConfig, spec: Any) -> str:
    """A string naming everything that decides the bytes inside one block.

    On CPU the order inside a block belongs to the attention kernel, which picks an ISA-specific
    variant (AMX, AVX-512, NEON, ...); two engines that disagree on it must never share blocks, so
    the ISA is part of the name. vLLM exposes that choice only through a private helper, hence the
    guarded import: if it moves, the name says "unknown" and such engines still share only with
    each other.
    """
    device = str(vllm_config.device_config.device_type)
    kv_layout = str(getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default")
    parts = [f"vllm-{device}", f"block{spec.block_size}", f"kv{kv_layout}"]
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(
                spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
            )
        except Exception as exc:  # any failure only narrows sharing; it never corrupts
            logger.warning("cannot tell the CPU attention ISA (%s); naming it 'unknown'", exc)
            isa = "unknown"
        parts.append(f"isa-{isa}")
    return "/".join(parts)


def base_namespace(
    vllm_config: VllmConfig, shape: EngineShape, settings: ConnectorSettings, tp_rank: int
) -> Namespace:
    """The engine-wide namespace (no LoRA, no cache salt) for one tensor-parallel rank."""
    model = vllm_config.model_config
    return Namespace(
        model=str(model.model),
        revision=str(model.revision or "main"),
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        dtype=shape.dtype,
        # Pipeline stages hold different layers; naming the stage keeps them apart.
        cache_layout=f"{shape.layout}/pp{shape.pp_rank}of{shape.pp_size}"
        + (f"/groups-{shape.groups}" if shape.groups else ""),
        tp_rank=tp_rank,
        tp_size=shape.tp_size,
        tenant=settings.tenant,
    )


def make_hasher(
    settings: ConnectorSettings, base: Namespace, lora_id: str, cache_salt: str
) -> ChunkHasher:
    """The chunk hasher for requests with this LoRA adapter and cache salt."""
    return ChunkHasher(
        settings.chunk_size,
        base.for_request(lora_id, cache_salt),
        secret=settings.secret.encode(),
        algorithm=settings.hash_algorithm,
    )


def rank_keys(
    keys: Sequence[bytes], namespace: Namespace, tp_rank: int, pp_rank: int
) -> list[bytes]:
    """The keys under which one tensor-parallel rank / pipeline stage stores its shard.

    The scheduler names chunks once, in rank 0's namespace, and every worker receives those
    names; each other rank must store its own shard under names of its own, or ranks would
    overwrite each other's blocks. Its key is the scheduler's key hashed with the rank's own
    namespace fingerprint (which includes the rank), so names stay unique per rank and per
    namespace while rank 0 keeps the scheduler's names that lookups check.
    """
    if tp_rank == 0 and pp_rank == 0:
        return list(keys)
    salt = _RANK_TAG + namespace.fingerprint()
    return [xxhash.xxh3_128_digest(salt + key) for key in keys]


@dataclass
class StepPlan:
    """The plan for one engine step, built by the scheduler half for the workers."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    #: The scheduler's chunk size (0: not said); a worker whose own differs stops
    #: (:meth:`kvstore.integrations.vllm.scheme.SchemeCheck.plan_agrees`).
    chunk_size: int = 0
