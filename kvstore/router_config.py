"""The ``[router]`` settings of ``kvstore router`` (loaded by :func:`kvstore.config.load_config`
like every other section; kept here so that the loader stays small)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["RouterConfig"]

# The same tuple as kvstore.router.scoring.POLICIES (this leaf module imports nothing above it).
_POLICIES = ("kv", "round_robin", "least_loaded")
# What router.max_body_bytes may be: from a tiny completion to far past any prompt.
_MAX_BODY_RANGE = (1024, 1024**3)


@dataclass(frozen=True)
class RouterConfig:
    """``kvstore router`` (:mod:`kvstore.router`): the replicas, scoring, the index query.

    ``replicas``: comma-separated ``URL=NODE_ID`` (the kvstore node beside each engine).
    ``namespace``, ``chunk_size``, ``hash_algorithm``: deprecated; the router names chunks by the
    key scheme the nodes publish in the cluster index (:mod:`kvstore.router.fleet_keys`) and
    uses these (the engines' rank-0 base namespace as a JSON object of
    :class:`~kvstore.keys.Namespace` fields, as the connector logs it) only while no node
    publishes one, or without an index.
    ``prefill`` / ``decode``: P/D mode (:mod:`kvstore.router.pd`), instead of ``replicas``:
    comma-separated ``URL=NODE_ID`` of the ``kv_producer`` and the ``kv_consumer`` engines.
    ``prefill_timeout_s``: how long a prefill may take before the decode replica computes the
    prompt itself.
    ``max_body_bytes``: the largest request body the router reads (a size, e.g. ``16MiB``, the
    default: a 2M-token prompt as ids, or 4 MiB of text with room to spare); a request whose
    ``Content-Length`` says more is answered 413 before a byte of its body is read.
    """

    listen: str = "127.0.0.1:8000"
    replicas: str = ""
    namespace: str = ""
    chunk_size: int = 256
    hash_algorithm: str = "xxh3_128"
    tokenizer: str = ""
    tenant: str = ""
    provisional_ttl_s: float = 5.0
    #: The index query's deadline floor; the deadline follows measured latency up to
    #: ``index_timeout_max_s`` (:mod:`kvstore.router.index_query`); a cap at or below the floor
    #: fixes the deadline at ``index_timeout_s`` (as before the cap existed: a config that set
    #: ``index_timeout_s`` above 1 keeps its fixed deadline).
    index_timeout_s: float = 0.1
    index_timeout_max_s: float = 1.0
    index_retry_s: float = 1.0
    hit_weight: float = 2.0
    request_cost_tokens: int = 256
    prefill: str = ""
    decode: str = ""
    prefill_timeout_s: float = 60.0
    #: ``kv`` (cached prefix against load), ``round_robin`` or ``least_loaded`` (baselines).
    policy: str = "kv"
    max_body_bytes: int = 16 * 1024**2

    def __post_init__(self) -> None:
        if self.policy not in _POLICIES:
            raise ConfigError(
                f"router.policy: cannot use {self.policy!r}: one of {', '.join(_POLICIES)}"
            )
        low, high = _MAX_BODY_RANGE
        if not low <= self.max_body_bytes <= high:
            raise ConfigError(
                f"router.max_body_bytes: cannot use {self.max_body_bytes}: a size from 1KiB "
                f"({low}) to 1GiB ({high}), e.g. 64MiB"
            )
        if self.chunk_size < 1:
            raise ConfigError(f"router.chunk_size must be >= 1, got {self.chunk_size}")
        for name in (
            "provisional_ttl_s",
            "index_timeout_s",
            "index_timeout_max_s",
            "index_retry_s",
            "hit_weight",
            "prefill_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"router.{name} must be > 0, got {getattr(self, name)}")
        if self.request_cost_tokens < 0:
            raise ConfigError(
                f"router.request_cost_tokens must be >= 0, got {self.request_cost_tokens}"
            )
