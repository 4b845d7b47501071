"""The backend's figures, as Prometheus counters of the process that runs it.

SGLang runs its storage backend in each scheduler process (one per TP rank). The counters live
in ``prometheus_client``'s default registry of that process, labelled with the rank
(``tp_rank``), in pages (one page is ``--page-size`` tokens):

- ``kvstore_sglang_pages_looked_up_total``: pages ``batch_exists`` asked about;
- ``kvstore_sglang_pages_hit_total``: of those, the leading pages kvstore held;
- ``kvstore_sglang_pages_loaded_total``: pages copied into SGLang's host pool;
- ``kvstore_sglang_pages_stored_total``: pages SGLang's host pool handed to kvstore and that
  kvstore holds now (newly stored or already there);
- ``kvstore_sglang_pages_failed_total{op, reason}``: pages of a ``load``, ``store`` or
  ``lookup`` that failed, by :data:`REASONS`.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter

__all__ = ["REASONS", "Metrics"]

#: Why pages failed: ``missing`` (not stored, or no longer), ``corrupt`` (the block changed under
#: the copy, or was not a page's size), ``store_down`` (the backend had stopped calling a failed
#: store for a while), ``unavailable`` (the call could not reach the store), ``deadline`` (it ran
#: past its deadline), ``error`` (the store refused it), ``no_room`` (the store had no space),
#: ``bad_indices`` (SGLang's host indices were not whole pages), ``stopped`` (the key scheme
#: changed under a running engine: the backend stopped for good).
REASONS = (
    "missing",
    "corrupt",
    "store_down",
    "unavailable",
    "deadline",
    "error",
    "no_room",
    "bad_indices",
    "stopped",
)

_LOCK = threading.Lock()
_COUNTERS: dict[str, Counter] = {}
_HELP = {
    "pages_looked_up": "Pages SGLang asked kvstore about (batch_exists).",
    "pages_hit": "Leading pages kvstore held of those asked about.",
    "pages_loaded": "Pages copied from kvstore into SGLang's host pool.",
    "pages_stored": "Pages of SGLang's host pool that kvstore holds after a store call.",
}


def _counter(name: str, labels: tuple[str, ...]) -> Counter:
    # One series per name and process: several backends in one process (tests) share them.
    with _LOCK:
        if name not in _COUNTERS:
            text = _HELP.get(name, "Pages of a kvstore load, store or lookup that failed.")
            _COUNTERS[name] = Counter(f"kvstore_sglang_{name}", text, labels)
        return _COUNTERS[name]


class Metrics:
    """The counters of one backend (one TP rank)."""

    def __init__(self, tp_rank: int) -> None:
        rank = str(tp_rank)
        self._looked_up = _counter("pages_looked_up", ("tp_rank",)).labels(rank)
        self._hit = _counter("pages_hit", ("tp_rank",)).labels(rank)
        self._loaded = _counter("pages_loaded", ("tp_rank",)).labels(rank)
        self._stored = _counter("pages_stored", ("tp_rank",)).labels(rank)
        self._failed = _counter("pages_failed", ("tp_rank", "op", "reason"))
        self._rank = rank

    def looked_up(self, pages: int, hits: int) -> None:
        """A lookup of ``pages`` pages found the leading ``hits``."""
        self._looked_up.inc(pages)
        self._hit.inc(hits)

    def loaded(self, pages: int) -> None:
        """``pages`` pages reached the host pool."""
        self._loaded.inc(pages)

    def stored(self, pages: int) -> None:
        """kvstore holds ``pages`` more pages of a store call."""
        self._stored.inc(pages)

    def failed(self, op: str, reason: str, pages: int) -> None:
        """``pages`` pages of a ``load``, ``store`` or ``lookup`` failed for ``reason``."""
        assert reason in REASONS, reason
        if pages:
            self._failed.labels(self._rank, op, reason).inc(pages)
