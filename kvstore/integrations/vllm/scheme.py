"""The connector's chunk size and hash algorithm: its store's, agreed on at start.

A deployment sets its key scheme in one place, the node's ``[keys]`` settings
(:mod:`kvstore.key_scheme`); a connector whose chunks were named otherwise than its node's engine
events and its router's would miss on every request, silently. So each half of the connector
asks its store at start (``KeyScheme``: it declares the engine's base namespace and the
fingerprint of its key secret) and names chunks with the answer:

* ``chunk_size`` / ``hash_algorithm`` in ``kv_connector_extra_config`` are optional; given and
  different from the store's, the connector logs one ERROR line naming both values and refuses to
  start (:class:`~kvstore.errors.ConfigError`). So does a refusal by the store (another key
  secret, a namespace of another tenant, too many namespaces), and a store chunk size that is no
  multiple of the engine's block size.
* A store that cannot be reached at start does not stop the engine: the connector uses its
  configured values (else the defaults), logs one WARNING, and asks again once the store answers
  (``when_reconnected``; a store that was only slow to answer, after ``retry_after_s``). If the
  answer then differs from what it named chunks with, it stops loading and saving for good (its
  breaker held open) with one ERROR line: chunk sizes are never mixed.
* The scheduler half tells the workers its chunk size in every step plan; a worker whose own
  differs (one half reached the store, the other not) stops loading and saving the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from kvstore.errors import (
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
    StoreUnavailableError,
)
from kvstore.integrations.store_client import StoreClient
from kvstore.integrations.vllm.common import (
    Breaker,
    ConnectorSettings,
    EngineShape,
    check_whole_blocks,
)
from kvstore.key_scheme import KeyScheme, secret_fingerprint
from kvstore.keys import Namespace

__all__ = ["SCHEME_SETTINGS", "SchemeCheck", "open_scheme"]

logger = logging.getLogger(__name__)

#: The connector settings the store's key scheme decides (each optional in the connector's config).
SCHEME_SETTINGS = ("chunk_size", "hash_algorithm")
#: The store's refusals of a declaration: the engine must not start with them.
_REFUSALS = (NamespaceMismatchError, PermissionDeniedError, CapacityError, InvalidRequestError)


class SchemeCheck:
    """Agrees one half's chunk size and hash algorithm with its store (see the module doc).

    ``settings`` (after construction) are the connector's settings with the store's values
    filled in; ``breaker`` is held open should the store later answer differently.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        client: StoreClient,
        namespace: Namespace,
        block_size: int,
        breaker: Breaker,
        side: str,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._block_size = block_size
        self._breaker = breaker
        self._side = side
        self._retry_after_s = settings.retry_after_s
        self._lock = threading.Lock()
        self._stopped = False  # an ERROR about the scheme has been logged; the store is off
        self._secret_check = secret_fingerprint(settings.secret)
        if "chunk_size" in settings.pinned:
            where = "kv_connector_extra_config chunk_size"
            check_whole_blocks(settings.chunk_size, block_size, where)
        self.settings = self._resolve(settings)

    def _resolve(self, settings: ConnectorSettings) -> ConnectorSettings:
        try:
            answer = self._ask(settings.timeout_s)
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            logger.warning(
                "kvstore connector (%s): the store did not answer at start (%s); naming chunks "
                "with chunk_size=%d hash_algorithm=%s until it does, then checking them",
                self._side,
                exc,
                settings.chunk_size,
                settings.hash_algorithm,
            )
            self._watch(exc)
            return settings
        except _REFUSALS as exc:
            message = f"kvstore connector ({self._side}): the store refused its key scheme: {exc}"
            logger.error(message)
            raise ConfigError(message) from exc
        except KVStoreError as exc:  # an older store without KeyScheme, say
            logger.warning(
                "kvstore connector (%s): cannot ask the store for its key scheme (%s); naming "
                "chunks with chunk_size=%d hash_algorithm=%s",
                self._side,
                exc,
                settings.chunk_size,
                settings.hash_algorithm,
            )
            return settings
        differences = _differences(settings, answer, pinned_only=True)
        if differences:
            message = self._mismatch(differences, "set it to the store's or leave it out")
            logger.error(message)
            raise ConfigError(message)
        check_whole_blocks(answer.chunk_size, self._block_size, "the store's keys.chunk_size")
        return dataclasses.replace(
            settings, chunk_size=answer.chunk_size, hash_algorithm=answer.hash_algorithm
        )

    def _ask(self, timeout: float) -> KeyScheme:
        return self._client.key_scheme(self._namespace, self._secret_check, timeout=timeout)

    def _mismatch(self, differences: list[str], advice: str) -> str:
        return (
            f"kvstore connector ({self._side}): {'; '.join(differences)} (node's [keys] "
            f"settings): {advice}"
        )

    def _watch(self, error: KVStoreError) -> None:
        """Ask again once the store answers: when it connects afresh where it was unreachable;
        after ``retry_after_s`` where it was only slow (its connection may stay up meanwhile)."""
        if isinstance(error, StoreUnavailableError):
            self._client.when_reconnected(self._reconnected)
            return
        timer = threading.Timer(max(self._retry_after_s, 1.0), self._recheck)
        timer.daemon = True
        timer.start()

    def _reconnected(self) -> None:
        # Called on gRPC's connectivity thread: the call it makes must not block that thread.
        threading.Thread(target=self._recheck, name="kvstore-scheme", daemon=True).start()

    def _recheck(self) -> None:
        """Ask the store again, after it was unreachable at start; stop on a difference."""
        try:
            answer = self._ask(self.settings.timeout_s)
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            self._watch(exc)  # lost again before it answered: wait for the next answer
            return
        except _REFUSALS as exc:
            self._stop(f"kvstore connector ({self._side}): the store refused its key scheme: {exc}")
            return
        except Exception as exc:  # on a thread of its own: a failure here would go unseen
            logger.warning("kvstore connector (%s): key scheme not checked: %s", self._side, exc)
            return
        differences = _differences(self.settings, answer, pinned_only=False)
        if differences:
            self._stop(self._mismatch(differences, "not loading or saving any more (restart it)"))
        else:
            logger.info(
                "kvstore connector (%s): the store confirms chunk_size=%d hash_algorithm=%s",
                self._side,
                self.settings.chunk_size,
                self.settings.hash_algorithm,
            )

    def plan_agrees(self, chunk_size: int) -> bool:
        """Whether a step plan's chunk size (the scheduler's; 0: not said) is this half's; the
        first time not, stop loading and saving with one ERROR line."""
        if not chunk_size or chunk_size == self.settings.chunk_size:
            return True
        self._stop(
            f"kvstore connector ({self._side}): the scheduler names chunks of {chunk_size} tokens, "
            f"this worker of {self.settings.chunk_size} (one of them did not reach the store at "
            "start): not loading or saving any more (restart the engine)"
        )
        return False

    def _stop(self, message: str) -> None:
        with self._lock:
            first, self._stopped = not self._stopped, True
        self._breaker.hold()
        if first:
            logger.error(message)


def open_scheme(
    settings: ConnectorSettings,
    client: StoreClient,
    namespace: Namespace,
    shape: EngineShape,
    breaker: Breaker,
    side: str = "scheduler",
) -> SchemeCheck:
    """The :class:`SchemeCheck` of one half; ``client`` is closed if it refuses to start."""
    try:
        return SchemeCheck(settings, client, namespace, shape.block_size, breaker, side)
    except ConfigError:
        client.close()
        raise


def _differences(settings: ConnectorSettings, answer: KeyScheme, pinned_only: bool) -> list[str]:
    """One phrase per scheme setting where ``settings`` differ from the store's ``answer``
    (``pinned_only``: only those the connector's config set)."""
    found = []
    for name in SCHEME_SETTINGS:
        mine, theirs = getattr(settings, name), getattr(answer, name)
        pinned = name in settings.pinned
        if mine != theirs and (pinned or not pinned_only):
            where = "kv_connector_extra_config" if pinned else "the connector's default"
            found.append(f"{where} {name}={mine!r} differs from the store's keys.{name}={theirs!r}")
    return found
