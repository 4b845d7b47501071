"""What a vLLM request asks the store to do with its prompt chunks, read from its
``kv_transfer_params`` (see :mod:`kvstore.retention`)::

    {"kvstore_retention_s": 3600}          keep its chunks an hour (a hit restarts the hour)
    {"kvstore_retention_tiers": "fast"}    memory tiers only: never nvme or Redis
    {"kvstore_retention_tiers": "none"}    do not store its chunks at all

Both keys may be given together. A value that is not one of these is logged (naming the key and
what it takes) and the request's chunks are not stored: a typo of ``"none"`` must not store what
its sender asked to keep out. Seconds over the store's ``max_retention_s`` are refused by the
store, and the save fails (logged by the worker, counted as a failed save).
"""

from __future__ import annotations

import logging
from typing import Any

from kvstore.errors import InvalidRequestError
from kvstore.retention import KEEP, RETENTION_TIERS, Retention

__all__ = ["RETENTION_SECONDS_KEY", "RETENTION_TIERS_KEY", "request_retention"]

logger = logging.getLogger(__name__)

#: The ``kv_transfer_params`` key of the seconds to keep a request's chunks.
RETENTION_SECONDS_KEY = "kvstore_retention_s"
#: The ``kv_transfer_params`` key of the tiers a request's chunks may go to.
RETENTION_TIERS_KEY = "kvstore_retention_tiers"

_NOT_STORED = Retention(tiers="none")


def request_retention(params: Any, req_id: str = "") -> Retention:
    """The retention ``params`` (a request's ``kv_transfer_params``) asks for; see the module
    docstring for what a bad value gives."""
    if not isinstance(params, dict):
        return KEEP
    seconds = params.get(RETENTION_SECONDS_KEY, 0)
    tiers = params.get(RETENTION_TIERS_KEY, "all")
    if seconds == 0 and tiers == "all":
        return KEEP
    try:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidRequestError(f"must be a number of seconds, got {seconds!r}")
        return Retention(float(seconds), tiers if isinstance(tiers, str) else repr(tiers))
    except InvalidRequestError as exc:
        logger.warning(
            "request %s: kv_transfer_params %s=%r, %s=%r: %s (%s takes seconds >= 0, %s one of "
            "%s); not storing its chunks",
            req_id,
            RETENTION_SECONDS_KEY,
            seconds,
            RETENTION_TIERS_KEY,
            tiers,
            exc,
            RETENTION_SECONDS_KEY,
            RETENTION_TIERS_KEY,
            list(RETENTION_TIERS),
        )
        return _NOT_STORED
