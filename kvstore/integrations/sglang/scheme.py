"""The backend's page size and hash algorithm against its store's key scheme, agreed at start.

A deployment sets its chunk size and hash algorithm once, in the node's ``[keys]`` settings
(:mod:`kvstore.key_scheme`). SGLang's page is the backend's chunk: so the backend declares its
base namespace and its key secret's fingerprint to the store (``KeyScheme``) and

* refuses to start (one ERROR line naming both settings and their values) where SGLang's
  ``--page-size`` is not the store's ``keys.chunk_size``, where ``hash_algorithm`` in the extra
  config is not the store's ``keys.hash_algorithm``, and where the store refuses the declaration
  (a missing or wrong token, another key secret, another tenant's namespace, too many
  namespaces);
* where the store does not answer at start, names pages with the extra config's hash algorithm
  (default ``xxh3_128``), logs one WARNING, and asks again once the store answers; an answer
  that differs then stops the backend for good (its breaker held open, one ERROR line): pages
  named two ways are never mixed.
"""

from __future__ import annotations

import logging
import threading

from kvstore.errors import (
    AuthenticationError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
    StoreUnavailableError,
)
from kvstore.integrations.breaker import Breaker
from kvstore.integrations.sglang.settings import BackendSettings, refuse
from kvstore.integrations.store_client import StoreClient
from kvstore.key_scheme import KeyScheme, engine_base, secret_fingerprint
from kvstore.keys import HashAlgorithm, Namespace

__all__ = ["SchemeAgreement", "differences"]

logger = logging.getLogger("kvstore.integrations.sglang")

#: The store's answers that stop SGLang's start: a missing or wrong token, another key secret,
#: another tenant's namespace, too many namespaces, a malformed declaration.
_REFUSALS = (
    AuthenticationError,
    NamespaceMismatchError,
    PermissionDeniedError,
    CapacityError,
    InvalidRequestError,
)


def differences(
    page_size: int, algorithm: HashAlgorithm, answer: KeyScheme, algorithm_pinned: bool
) -> list[str]:
    """One phrase per setting where the backend and its store's scheme ``answer`` disagree (the
    hash algorithm only where the extra config set it: otherwise the store's is taken)."""
    found = []
    if answer.chunk_size != page_size:
        found.append(
            f"SGLang's --page-size {page_size} differs from the store's keys.chunk_size "
            f"{answer.chunk_size}"
        )
    if algorithm_pinned and answer.hash_algorithm != algorithm:
        found.append(
            f"the extra config's hash_algorithm {algorithm!r} differs from the store's "
            f"keys.hash_algorithm {answer.hash_algorithm!r}"
        )
    return found


class SchemeAgreement:
    """The backend's hash algorithm, agreed with its store (see the module docstring)."""

    def __init__(
        self,
        client: StoreClient,
        namespace: Namespace,
        page_size: int,
        settings: BackendSettings,
        breaker: Breaker,
    ) -> None:
        self._client = client
        self._base = engine_base(namespace)
        self._page_size = page_size
        self._settings = settings
        self._breaker = breaker
        self._secret_check = secret_fingerprint(settings.secret)
        self._stopped = threading.Event()
        #: The hash algorithm pages are named with.
        self.hash_algorithm: HashAlgorithm = settings.hash_algorithm
        self._resolve()

    def _ask(self) -> KeyScheme:
        return self._client.key_scheme(
            self._base, self._secret_check, timeout=self._settings.timeout_s
        )

    def _resolve(self) -> None:
        try:
            answer = self._ask()
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            logger.warning(
                "kvstore HiCache backend: the store at %s did not answer at start (%s); naming "
                "pages of %d tokens with %s until it does, then checking them",
                self._settings.target,
                exc,
                self._page_size,
                self.hash_algorithm,
            )
            self._watch(exc)
            return
        except _REFUSALS as exc:
            refuse(f"kvstore HiCache backend: the store refused its key scheme: {exc}")
        except KVStoreError as exc:  # a store without KeyScheme, say
            logger.warning(
                "kvstore HiCache backend: cannot ask the store for its key scheme (%s); naming "
                "pages with %s",
                exc,
                self.hash_algorithm,
            )
            return
        found = self._differences(answer)
        if found:
            refuse(
                f"kvstore HiCache backend: {'; '.join(found)}: make them equal (the node's "
                "[keys] settings, or SGLang's flags)"
            )
        self.hash_algorithm = answer.hash_algorithm

    def _differences(self, answer: KeyScheme) -> list[str]:
        pinned = "hash_algorithm" in self._settings.pinned
        return differences(self._page_size, self.hash_algorithm, answer, pinned)

    def _watch(self, error: KVStoreError) -> None:
        """Ask again once the store answers (when it connects again; a store that was only slow,
        after ``retry_after_s``)."""
        if isinstance(error, StoreUnavailableError):
            self._client.when_reconnected(self._reconnected)
            return
        timer = threading.Timer(max(self._settings.retry_after_s, 1.0), self._recheck)
        timer.daemon = True
        timer.start()

    def _reconnected(self) -> None:
        # On gRPC's connectivity thread: the call below must not block it.
        threading.Thread(target=self._recheck, name="kvstore-sglang-scheme", daemon=True).start()

    def _recheck(self) -> None:
        try:
            answer = self._ask()
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            self._watch(exc)
            return
        except _REFUSALS as exc:
            self._stop(f"the store refused its key scheme: {exc}")
            return
        except Exception as exc:  # a thread of its own: a failure would go unseen
            logger.warning("kvstore HiCache backend: key scheme not checked: %s", exc)
            return
        pinned = {"hash_algorithm"} | set(self._settings.pinned)
        found = differences(
            self._page_size, self.hash_algorithm, answer, "hash_algorithm" in pinned
        )
        if found:
            self._stop("; ".join(found))
        else:
            logger.info(
                "kvstore HiCache backend: the store confirms pages of %d tokens named with %s",
                self._page_size,
                self.hash_algorithm,
            )

    def _stop(self, why: str) -> None:
        self._breaker.hold()
        if not self._stopped.is_set():
            self._stopped.set()
            logger.error(
                "kvstore HiCache backend: %s: not loading or storing any more (restart SGLang)",
                why,
            )

    @property
    def stopped(self) -> bool:
        """Whether the store's later answer stopped the backend."""
        return self._stopped.is_set()
