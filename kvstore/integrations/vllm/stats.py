"""The vLLM connector's figures, without vLLM: what kvstore did for one engine, in prompt tokens.

Each half of the connector keeps a :class:`ConnectorCounters`; vLLM takes a snapshot every engine
step (``get_kv_connector_stats``), sums the workers' and the scheduler's snapshots with
:func:`merge`, sends the sum to its front end, which adds it to its Prometheus counters
(:mod:`kvstore.integrations.vllm.metrics`) and logs :func:`summary` every log interval.

A snapshot is a plain dict (vLLM serialises it between processes) of these fields:

``lookup_tokens``
    prompt tokens the scheduler asked kvstore about (the whole chunks a request could load);
``hit_tokens``
    of those, the tokens kvstore held;
``loaded_tokens``
    tokens loaded into the engine's KV cache: the prompt tokens kvstore saved the engine from
    computing (blocks vLLM's own prefix cache already held are not counted). With several KV
    cache groups, the tokens of the anchor group (full attention where the model has it,
    :func:`kvstore.integrations.paged.groups.anchor_group`), once per token; a model whose only
    group is a sliding window counts the window's tokens it loaded;
``load_failed_tokens``
    ``{reason: tokens}`` planned for loading that could not be, which vLLM recomputes
    (see :data:`LOAD_FAILURES`);
``loaded_tokens_by_path``
    ``{path: tokens}``: the loaded tokens by the way they came (``shm-dma``, ``shm-staged``,
    ``shm-lease``, ``ucx-device``, ...; see :mod:`kvstore.integrations.vllm.fetch`), e.g. how
    many loads went through host staging while the arena was being page-locked;
``declined_tokens``
    of the hit tokens, those the load plan chose to recompute rather than load (a slow tier:
    see :mod:`kvstore.integrations.vllm.cost`);
``saved_tokens``
    prompt tokens this engine stored into kvstore (puts that succeeded; the anchor group's, as
    for ``loaded_tokens``);
``save_failed_tokens``
    ``{reason: tokens}`` planned for saving that never reached kvstore (see
    :data:`SAVE_FAILURES`);
``loaded_bytes_by_group``
    ``{kind/index: bytes}`` loaded into each KV cache group (``full/0``, ``sliding/1``, ...):
    a sliding-window group loads only its window's chunks
    (:mod:`kvstore.integrations.paged.groups`);
``unsupported_group_requests``
    ``{kind: requests}`` answered 0 tokens because the model has a group of a kind kvstore does
    not store (``state``, ``mixed``, ``other``; :mod:`kvstore.integrations.vllm.hybrid`);
``lookup_seconds``, ``load_seconds``
    the latency of each lookup and of each step's batched get.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = [
    "LOAD_FAILURES",
    "SAVE_FAILURES",
    "ConnectorCounters",
    "empty",
    "is_empty",
    "merge",
    "summary",
]

#: Why a planned load failed: ``missing`` (kvstore no longer had the chunk: evicted or absent
#: since the lookup), ``store_down`` (the connector had stopped calling an unreachable store),
#: ``unavailable`` (the get could not reach the store), ``deadline`` (the get ran past
#: ``timeout_s``), ``error`` (the store refused the get), ``layer_skipped`` (a layer's attention
#: never asked for its blocks, so the step is recomputed), ``not_ready`` (no KV cache registered).
LOAD_FAILURES = (
    "missing",
    "store_down",
    "unavailable",
    "deadline",
    "error",
    "layer_skipped",
    "not_ready",
)
#: Why a planned save never reached kvstore: ``backlog_full`` (puts waiting held too much
#: memory), ``store_down``, ``unavailable``, ``deadline``, ``error`` (as for loads).
SAVE_FAILURES = ("backlog_full", "store_down", "unavailable", "deadline", "error")

_COUNTS = ("lookup_tokens", "hit_tokens", "declined_tokens", "loaded_tokens", "saved_tokens")
_BY_REASON = (
    "load_failed_tokens",
    "save_failed_tokens",
    "loaded_tokens_by_path",
    "loaded_bytes_by_group",
    "unsupported_group_requests",
)
_LATENCIES = ("lookup_seconds", "load_seconds")


def empty() -> dict[str, Any]:
    """A snapshot with nothing in it."""
    data: dict[str, Any] = {name: 0 for name in _COUNTS}
    data.update({name: {} for name in _BY_REASON})
    data.update({name: [] for name in _LATENCIES})
    return data


def is_empty(data: dict[str, Any]) -> bool:
    """Whether ``data`` records nothing at all."""
    return not (
        any(data.get(name) for name in _COUNTS)
        or any(data.get(name) for name in _BY_REASON)
        or any(data.get(name) for name in _LATENCIES)
    )


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other`` to ``into`` (in place) and return ``into``; absent fields count as empty."""
    for name in _COUNTS:
        into[name] = int(into.get(name, 0)) + int(other.get(name, 0))
    for name in _BY_REASON:
        reasons: dict[str, int] = dict(into.get(name) or {})
        for reason, tokens in (other.get(name) or {}).items():
            reasons[reason] = reasons.get(reason, 0) + int(tokens)
        into[name] = reasons
    for name in _LATENCIES:
        into[name] = [*(into.get(name) or ()), *(other.get(name) or ())]
    return into


def _mean_ms(values: list[float]) -> float:
    return round(1e3 * sum(values) / len(values), 3) if values else 0.0


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """One interval's figures as vLLM logs them (``KV Transfer metrics: ...``)."""
    looked_up = int(data.get("lookup_tokens", 0))
    hit = int(data.get("hit_tokens", 0))
    out: dict[str, int | float] = {
        "kvstore lookup tokens": looked_up,
        "kvstore hit tokens": hit,
        "kvstore hit rate": round(hit / looked_up, 4) if looked_up else 0.0,
        "kvstore declined tokens": int(data.get("declined_tokens", 0)),
        "kvstore loaded tokens": int(data.get("loaded_tokens", 0)),
        "kvstore saved tokens": int(data.get("saved_tokens", 0)),
    }
    for name, label in (
        ("loaded_tokens_by_path", "loaded"),
        ("load_failed_tokens", "load failed"),
        ("save_failed_tokens", "save failed"),
        ("loaded_bytes_by_group", "loaded bytes"),
        ("unsupported_group_requests", "unsupported group requests"),
    ):
        for reason, tokens in sorted((data.get(name) or {}).items()):
            unit = "" if label.endswith(("bytes", "requests")) else " tokens"
            out[f"kvstore {label}{unit} ({reason})"] = int(tokens)
    out["kvstore avg lookup ms"] = _mean_ms(list(data.get("lookup_seconds") or ()))
    out["kvstore avg load ms"] = _mean_ms(list(data.get("load_seconds") or ()))
    return out


class ConnectorCounters:
    """One connector half's figures since the last :meth:`take`; safe to use from any thread
    (lookups, fetches and puts record from the connector's background threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()

    def record_lookup(self, tokens: int, hit_tokens: int, seconds: float | None) -> None:
        """A request's lookup answered: ``tokens`` asked, ``hit_tokens`` held; ``seconds`` the
        lookup took (``None`` when the store was not asked)."""
        with self._lock:
            self._data["lookup_tokens"] += tokens
            self._data["hit_tokens"] += hit_tokens
            if seconds is not None:
                self._data["lookup_seconds"].append(seconds)

    def record_declined(self, tokens: int) -> None:
        """``tokens`` held by kvstore that the load plan chose to recompute."""
        if tokens:
            with self._lock:
                self._data["declined_tokens"] += tokens

    def record_lookup_latency(self, seconds: float) -> None:
        """A lookup RPC's latency, recorded where it ran."""
        with self._lock:
            self._data["lookup_seconds"].append(seconds)

    def record_load(
        self, loaded_tokens: int, failed: dict[str, int], seconds: float | None, path: str = ""
    ) -> None:
        """A step's loads done: ``loaded_tokens`` written (by ``path``, the way they came),
        ``failed`` tokens by reason."""
        with self._lock:
            self._data["loaded_tokens"] += loaded_tokens
            if path:
                _add(self._data["loaded_tokens_by_path"], {path: loaded_tokens})
            _add(self._data["load_failed_tokens"], failed)
            if seconds is not None:
                self._data["load_seconds"].append(seconds)

    def record_group_bytes(self, group: str, nbytes: int) -> None:
        """``nbytes`` loaded into KV cache group ``group`` (its ``kind/index`` label)."""
        with self._lock:
            _add(self._data["loaded_bytes_by_group"], {group: nbytes})

    def record_unsupported(self, kinds: list[str]) -> None:
        """A request answered 0 tokens for the model's unsupported group ``kinds``."""
        with self._lock:
            _add(self._data["unsupported_group_requests"], dict.fromkeys(kinds, 1))

    def record_save(self, tokens: int) -> None:
        """``tokens`` stored into kvstore."""
        with self._lock:
            self._data["saved_tokens"] += tokens

    def record_save_failed(self, reason: str, tokens: int) -> None:
        """``tokens`` planned for saving that never reached kvstore, and why."""
        with self._lock:
            _add(self._data["save_failed_tokens"], {reason: tokens})

    def take(self) -> dict[str, Any] | None:
        """The figures since the last call (``None`` if there are none), and start afresh."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data


def _add(into: dict[str, int], more: dict[str, int]) -> None:
    for reason, tokens in more.items():
        if tokens:
            into[reason] = into.get(reason, 0) + tokens
