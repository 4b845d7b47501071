"""The vLLM connector's ``kv_connector_extra_config`` keys, described like every setting.

The connector reads its keys itself (:class:`kvstore.integrations.vllm.common.ConnectorSettings`,
which checks their values), from the dict vLLM hands it; it has no environment variables nor
flags of its own. What each key means, its default and the values it allows are declared here
once, with the same :func:`~kvstore.config.meta.setting` metadata as the loader's sections, so
that the settings page lists them (``scripts/gen_settings_table.py``) and a test keeps them and
the connector's keys and defaults the same.

This is a description, not a section: :func:`~kvstore.config.load_config` never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.meta import setting
from kvstore.key_scheme import DEFAULT_CHUNK_SIZE, HASH_ALGORITHMS

__all__ = ["LOAD_POLICIES", "ConnectorKeys"]

#: ``load_policy`` values (the connector's own tuple, ``common.LOAD_POLICIES``, is the same).
LOAD_POLICIES = ("cost", "always", "never")


@dataclass(frozen=True)
class ConnectorKeys:
    """The keys of ``kv_connector_extra_config`` (one field each, in the order a reader meets
    them): where the store is, how chunks are named, deadlines, credentials, hand-off, loads."""

    target: str = setting(
        "",
        help="`HOST:PORT` of the `kvstore serve` process (required)",
        default_doc="(required)",
    )
    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE,
        help="tokens per stored chunk, a multiple of the engine's block size; best left out: the "
        "connector then takes its store's `keys.chunk_size`, and set, the store must agree or "
        "the engine does not start",
        default_doc="the store's `keys.chunk_size`",
    )
    tenant: str = setting(
        "", help="isolates one tenant's blocks from another's (part of the namespace)"
    )
    timeout_s: float = setting(5.0, help="deadline of each get and put, in seconds")
    lookup_timeout_s: float = setting(
        0.5,
        help="deadline of a scheduler lookup; after it the request goes ahead as a miss (the "
        "scheduler keeps running other requests meanwhile)",
    )
    retry_after_s: float = setting(
        5.0,
        help="after the store fails a call, how long it is left alone (misses, no saves); an "
        "unreachable store is tried again as soon as its connection comes back",
    )
    hash_algorithm: str = setting(
        "xxh3_128",
        kind="choice",
        choices=HASH_ALGORITHMS,
        help="how chunk keys are hashed, `xxh3_128` or `sha256`; best left out, as `chunk_size`",
        default_doc="the store's `keys.hash_algorithm`",
    )
    secret: str = setting(
        "",
        help="the key-derivation secret; every replica sharing a store must use the same one",
        default_doc="`$KVSTORE_HASH_SECRET`",
        secret=True,
    )
    token: str = setting(
        "",
        help="bearer token, for a server with `auth.tokens_file`",
        default_doc="`$KVSTORE_TOKEN`",
        secret=True,
    )
    tls_ca: str = setting(
        "", help="PEM file of the CA of a TLS server", default_doc="`$KVSTORE_TLS_CA`"
    )
    handoff_wait_s: float = setting(
        2.0,
        help="prefill/decode hand-off: how long a request carrying a producer's saved-chunk "
        "count waits for those chunks to reach the store before it goes ahead with those that "
        "arrived",
    )
    load_policy: str = setting(
        "cost",
        kind="choice",
        choices=LOAD_POLICIES,
        help="which stored chunks to load: `cost` those that load faster than the engine "
        "recomputes them, `always` every hit, `never` none (a baseline)",
    )
