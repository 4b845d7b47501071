"""The connector's roles (``kv_transfer_config.kv_role``) and the prefill/decode hand-off field.

See :mod:`kvstore.integrations.vllm.scheduler` for what each role does.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import ConfigError

__all__ = ["HANDOFF_KEY", "KV_ROLES", "kv_role"]

#: ``kv_transfer_config.kv_role`` values the connector takes.
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
#: The ``kv_transfer_params`` key of a producer's output (and of the decode request that carries
#: it on): the request's leading whole prompt chunks that are stored or being stored.
HANDOFF_KEY = "kvstore_saved_chunks"


def kv_role(vllm_config: Any) -> str:
    """The engine's ``kv_role``; none set (no transfer config) is ``kv_both``."""
    role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None)
    if role is None:
        return "kv_both"
    if role not in KV_ROLES:
        raise ConfigError(
            f"kv_transfer_config.kv_role: cannot use {role!r}: one of {', '.join(KV_ROLES)}"
        )
    return str(role)


def _handoff_chunks(request: Any) -> int:
    """The producer's saved-chunk count a request carries (0: none, or not a count)."""
    params = getattr(request, "kv_transfer_params", None)
    value = params.get(HANDOFF_KEY) if isinstance(params, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 0
