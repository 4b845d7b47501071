"""Why a request went where it went: the decision record, its log line and its metrics.

Every routed request gets one reason, counted in ``kvstore_router_decisions_total{replica,
reason}``:

* ``prefix``: the chosen replica reuses more of the prompt than every replica would (real
  prefix routing; :mod:`.scoring` says how tokens are credited);
* ``shared_prefix``: every replica would reuse the same prefix (a system prompt all of them
  cache): that prefix decided nothing, load did;
* ``load``: no replica reuses any of the prompt (or one that did lost to load);
* ``index_timeout``: the index did not answer within its deadline (:mod:`.index_query`);
* ``index_unavailable``: no index is configured, it failed, or it is skipped for
  ``router.index_retry_s`` after failing;
* ``no_tokens``: the prompt's token ids (or, in P/D mode without ``router.namespace``, its
  chunk keys) are unknown;
* ``round_robin``: that baseline policy.

The last four route by load and the router's own provisional entries alone (the finer cause is in
``kvstore_router_fallbacks_total{reason}``). ``kvstore_router_credited_beyond_shared_tokens``
shows how much each choice reused beyond what every replica holds: a fleet whose choices are all
``shared_prefix`` or near 0 there is not gaining from KV-aware routing. At DEBUG, one line per
request (logger ``kvstore.router.decision``)::

    route #12 -> http://10.0.0.5:8000 prefix: credited {a:576 b:32} shared 32 prompt 600;
    index ok 1.3 ms (deadline 100 ms)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvstore.router.metrics import RouterMetrics
from kvstore.router.scoring import Decision

__all__ = ["FALLBACK_REASONS", "REASONS", "DecisionRecord", "reason_for"]

logger = logging.getLogger(__name__)

#: Every value of ``kvstore_router_decisions_total``'s ``reason``.
REASONS = (
    "prefix",
    "shared_prefix",
    "load",
    "index_timeout",
    "index_unavailable",
    "no_tokens",
    "round_robin",
)
#: Why a request had no index answer (``kvstore_router_fallbacks_total``'s ``reason``), and the
#: decision reason each one gives.
FALLBACK_REASONS = {
    "index_timeout": "index_timeout",
    "index_error": "index_unavailable",
    "index_down": "index_unavailable",
    "no_index": "index_unavailable",
    "no_tokens": "no_tokens",
    "no_namespace": "no_tokens",
}


def reason_for(decision: Decision, fallback: str) -> str:
    """The decision's reason: the scorer's, unless the index gave no answer (``fallback``)."""
    if decision.reason == "round_robin" or not fallback:
        return decision.reason
    return FALLBACK_REASONS[fallback]


@dataclass(frozen=True)
class DecisionRecord:
    """One request's decision and what it rested on."""

    number: int
    #: Its reason already the final one (:func:`reason_for`).
    decision: Decision
    #: Why the index gave no answer ("" if it answered or was not asked).
    fallback: str
    #: Whether the index was asked (not for a prompt shorter than a chunk, nor by a baseline).
    asked: bool
    prompt_tokens: int
    index_seconds: float
    deadline_seconds: float

    def count(self, metrics: RouterMetrics) -> None:
        """Into the router's metrics."""
        d = self.decision
        metrics.decisions.labels(d.replica.url, d.reason).inc()
        if self.fallback:
            metrics.fallbacks.labels(self.fallback).inc()
        metrics.score.observe(d.score)
        metrics.predicted_hit_tokens.observe(d.predicted_hit_tokens)
        metrics.beyond_shared.observe(d.predicted_hit_tokens - d.shared_tokens)
        metrics.prompt_tokens.observe(self.prompt_tokens)

    def line(self) -> str:
        """The DEBUG line (see the module docstring)."""
        d = self.decision
        credited = " ".join(f"{url}:{tokens}" for url, tokens in d.credited.items())
        if not self.asked and not self.fallback:
            index = "index not asked"
        elif self.fallback in ("", "index_timeout", "index_error"):
            status = "ok" if not self.fallback else self.fallback.removeprefix("index_")
            index = (
                f"index {status} {self.index_seconds * 1e3:.1f} ms "
                f"(deadline {self.deadline_seconds * 1e3:.0f} ms)"
            )
        else:
            index = self.fallback.replace("_", " ")
        return (
            f"route #{self.number} -> {d.replica.url} {d.reason}: credited {{{credited}}} "
            f"shared {d.shared_tokens} prompt {self.prompt_tokens}; {index}"
        )

    def log(self) -> None:
        """At DEBUG (formatted only when DEBUG is on)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", self.line())
