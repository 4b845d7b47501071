"""The ``[router]`` settings of ``kvstore router`` (loaded by :func:`kvstore.config.load_config`
like every other section; kept here so that the loader stays small)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.checks import (
    check_choices,
    require_at_least,
    require_between,
    require_positive,
)
from kvstore.config.meta import setting
from kvstore.deprecation import deprecated

__all__ = ["ROUTER_KEYS_DEPRECATED", "RouterConfig"]

#: How the router's warning names the deprecated settings it falls back to.
ROUTER_KEYS_DEPRECATED = deprecated(
    "router.namespace/router.chunk_size/router.hash_algorithm",
    "set keys.* on the nodes instead, which publish the scheme the router reads",
)

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

    listen: str = setting(
        "127.0.0.1:8000",
        help="HTTP address of `kvstore router`",
        flag="--listen",
        metavar="HOST:PORT",
    )
    replicas: str = setting(
        "",
        help=(
            "comma-separated `URL=NODE_ID`: each engine's OpenAI-compatible URL and the id of the "
            "kvstore node beside it"
        ),
        kind="list",
        metavar="URL=NODE_ID",
        short="a vLLM server and the kvstore node beside it",
        flag="--replica",
    )
    namespace: str = setting(
        "",
        help=(
            "deprecated: the router names chunks by the key scheme the nodes publish (`keys.*`); "
            "used only while no node publishes one (one WARNING line), or without an index"
        ),
        short="deprecated: the engines' base namespace as JSON, used only while no node "
        "publishes a key scheme",
        flag="--namespace",
        metavar="JSON",
    )
    chunk_size: int = setting(
        256,
        help="deprecated, as `router.namespace`",
        flag="--chunk-size",
        metavar="TOKENS",
    )
    hash_algorithm: str = setting(
        "xxh3_128",
        help="deprecated, as `router.namespace`",
    )
    tokenizer: str = setting(
        "",
        help="Hugging Face tokenizer files of the model, for requests sent as text (optional)",
        flag="--tokenizer",
        metavar="PATH",
    )
    tenant: str = setting(
        "",
        help="the kvstore tenant the engines use (its part of the index)",
        flag="--tenant",
        metavar="NAME",
    )
    provisional_ttl_s: float = setting(
        5.0,
        help="seconds a routed prefix counts as held by its replica before the index shows it",
    )
    # A cap at or below the floor fixes the deadline at index_timeout_s, as before the cap
    # existed: a config that set index_timeout_s above 1 keeps its fixed deadline.
    index_timeout_s: float = setting(
        0.1,
        help=(
            "floor of the index query's deadline, which follows measured latency (see the router "
            "section)"
        ),
    )
    index_timeout_max_s: float = setting(
        1.0,
        help="cap of that deadline (at or below the floor: a fixed deadline of `index_timeout_s`)",
    )
    index_retry_s: float = setting(
        1.0,
        help="how long the index is skipped once nothing has answered for longer than the cap",
    )
    hit_weight: float = setting(
        2.0,
        help=(
            "`kv` scoring: `hit_weight` * cached tokens - (queued prefill tokens + "
            "`request_cost_tokens` * requests in flight)"
        ),
    )
    request_cost_tokens: int = setting(
        256,
        help="the load one request in flight adds, in tokens (see `hit_weight`)",
    )
    prefill: str = setting(
        "",
        help=(
            "P/D mode, instead of `replicas`: the `kv_producer` engines, `URL=NODE_ID` "
            "comma-separated"
        ),
        kind="list",
        metavar="URL=NODE_ID",
        short=(
            "P/D mode, instead of --replica: a prefill replica (its connector's kv_role "
            "kv_producer) and the kvstore node beside it"
        ),
        flag="--prefill",
    )
    decode: str = setting(
        "",
        help="P/D mode: the `kv_consumer` engines",
        kind="list",
        metavar="URL=NODE_ID",
        short=(
            "P/D mode: a decode replica (its connector's kv_role kv_consumer) and the kvstore node"
            " beside it"
        ),
        flag="--decode",
    )
    prefill_timeout_s: float = setting(
        60.0,
        help="how long a prefill may take before the decode replica computes the prompt itself",
    )
    policy: str = setting(
        "kv",
        help="`kv` (cached prefix against load), `round_robin` or `least_loaded` (baselines)",
        flag="--policy",
        kind="choice",
        choices=_POLICIES,
    )
    max_body_bytes: int = setting(
        16 * 1024**2,
        help=(
            "the largest request body read (a size from `1KiB` to `1GiB`); past it, 413 before a "
            "byte is read"
        ),
        kind="size",
        flag="--max-body-bytes",
    )

    def __post_init__(self) -> None:
        check_choices("router", self)
        low, high = _MAX_BODY_RANGE
        require_between(
            "router.max_body_bytes",
            self.max_body_bytes,
            low,
            high,
            "a size from 1KiB to 1GiB, e.g. 64MiB",
        )
        require_at_least("router.chunk_size", self.chunk_size, 1)
        for name in (
            "provisional_ttl_s",
            "index_timeout_s",
            "index_timeout_max_s",
            "index_retry_s",
            "hit_weight",
            "prefill_timeout_s",
        ):
            require_positive(f"router.{name}", getattr(self, name))
        require_at_least("router.request_cost_tokens", self.request_cost_tokens, 0)
