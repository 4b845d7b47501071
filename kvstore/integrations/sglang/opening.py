"""How the backend starts on one rank, without SGLang: from its settings, SGLang's storage config
and host pool to a connected :class:`~kvstore.integrations.sglang.transfer.PageStore`.

The order matters: the host pool decides the page's shape, the shape the namespace, the
namespace the client (blocks carry it) and the key-scheme declaration; only the store's answer
(:class:`~kvstore.integrations.sglang.scheme.SchemeAgreement`) fixes the hash algorithm that
page keys are derived with. A refusal on the way (an unsupported pool, a page size other than
the store's chunk size, a refused declaration) raises :class:`~kvstore.errors.ConfigError` after
its one ERROR line, and SGLang does not start.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.integrations.breaker import Breaker, warm_up
from kvstore.integrations.sglang.identity import PageKeys, namespace_for, pool_shape
from kvstore.integrations.sglang.metrics import Metrics
from kvstore.integrations.sglang.pages import page_view
from kvstore.integrations.sglang.scheme import SchemeAgreement
from kvstore.integrations.sglang.settings import BackendSettings
from kvstore.integrations.sglang.transfer import PageStore

__all__ = ["open_pages"]

logger = logging.getLogger("kvstore.integrations.sglang")


def open_pages(
    settings: BackendSettings,
    config: Any,
    host_pool: Any,
    metrics: Metrics,
    *,
    data_plane: str | None = None,
) -> tuple[PageStore, SchemeAgreement]:
    """This rank's pages in the store, and its key-scheme agreement (see the module docstring).

    ``config`` is SGLang's ``HiCacheStorageConfig``, ``host_pool`` its host KV pool;
    ``data_plane`` overrides the client's (``"grpc"``: what a store on another host gets).
    """
    shape = pool_shape(host_pool)
    namespace = namespace_for(shape, config, settings)
    client = KVStoreClient(
        settings.target,
        namespace=namespace,
        timeout=settings.timeout_s,
        data_plane=data_plane,
        token=settings.token,
        tls_ca=settings.tls_ca,
    )
    breaker = Breaker(settings.retry_after_s, reconnected=client.when_reconnected)
    try:
        scheme = SchemeAgreement(client, namespace, shape.page_size, settings, breaker)
        keys = PageKeys(namespace, shape.page_size, settings.secret.encode(), scheme.hash_algorithm)
        pages = PageStore(
            client,
            breaker,
            metrics,
            keys,
            shape,
            page_view(host_pool.kv_buffer, shape),
            timeout_s=settings.timeout_s,
            lookup_timeout_s=settings.lookup_timeout_s,
            writer=bool(getattr(config, "is_storage_writer", True)),
        )
    except Exception:
        client.close()
        raise
    # The data plane (the shared-memory mapping of the arena and its index) is opened now, at
    # SGLang's start, rather than on its first lookup, whose deadline is short; a store that is
    # down or slow costs this at most its deadline (then misses until it answers).
    warm_up(client, breaker, settings.timeout_s)
    logger.info(
        "kvstore HiCache backend (TP rank %s): %s pages of %d tokens (%s layout, %s, %d B) in "
        "%s, model %r",
        getattr(config, "tp_rank", 0),
        shape.kind.upper(),
        shape.page_size,
        shape.layout,
        shape.dtype,
        shape.page_nbytes,
        settings.target,
        namespace.model,
    )
    return pages, scheme
