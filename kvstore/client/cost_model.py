"""Load or recompute: how many of a prompt's leading stored chunks are worth loading.

A hit is not always a win: a chunk in a slow tier (Redis behind a thin link, a peer across hosts)
can take longer to load than the engine takes to compute it again. :func:`plan_loads` weighs, per
chunk, the expected load time from the tier that holds it against the expected time to recompute
it, and picks the number of leading chunks ``k`` that minimises

    load(chunks [0, k)) + recompute(tokens [k * C, hits * C))

(the tokens after the hits are computed whichever ``k`` is chosen, so they do not enter). Loads go
one batch per tier, so a tier's fixed latency counts once, when the first chunk of that tier is
loaded; every chunk also pays the client's own path (``transfer``: shared memory, UCX or gRPC,
plus the device copy). A chunk that only the engine's own prefix cache needs (``held_tokens``)
costs nothing to "load".

Recomputing tokens ``[s, e)`` costs ``work(s, e) = (e - s) + (e² - s²) / (2 · context_scale)``
units at the engine's measured seconds per unit: each token costs the same in the linear layers
plus, in attention, an amount that grows with the context before it. For a decoder-only
transformer with hidden size ``d`` the attention part equals the linear part at a context of about
``6 d`` tokens, so ``context_scale = 6 * hidden_size`` (:func:`context_scale`); 0 leaves it out.

It decides the way the connector did before it existed wherever it lacks a figure: no prefill
rate, or no rate for a chunk's tier, means that chunk is loaded; a tie is loaded too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.protocol.rates import UNKNOWN, Rate

__all__ = ["LoadPlan", "context_scale", "plan_loads", "prefill_work"]


def context_scale(hidden_size: int) -> float:
    """The context length at which attention costs a token as much as the linear layers."""
    return 6.0 * hidden_size


def prefill_work(start: int, end: int, scale: float) -> float:
    """Work units of computing tokens ``[start, end)`` after ``start`` tokens of context."""
    if end <= start:
        return 0.0
    linear = float(end - start)
    if scale <= 0:
        return linear
    return linear + (end * end - start * start) / (2.0 * scale)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The decision for one request.

    Attributes:
        load: Leading chunks to load (``0 <= load <= hits``); the engine computes the rest.
        hits: Leading chunks the store holds.
        load_s: Expected seconds to load chunks ``[0, load)``.
        recompute_s: Expected seconds to compute chunks ``[load, hits)``.
        all_load_s: Expected seconds to load all ``hits`` chunks (what loading everything costs).
        all_recompute_s: Expected seconds to compute all ``hits`` chunks.
        reason: Why, in words: ``"loads win"``, ``"no prefill rate"``, or the tier where loading
            stopped winning.
    """

    load: int
    hits: int
    load_s: float = 0.0
    recompute_s: float = 0.0
    all_load_s: float = 0.0
    all_recompute_s: float = 0.0
    reason: str = "loads win"

    @property
    def declined(self) -> int:
        """Stored chunks that will be recomputed instead of loaded."""
        return self.hits - self.load


def plan_loads(
    tiers: Sequence[str],
    rates: Mapping[str, Rate],
    prefill: Rate,
    *,
    chunk_tokens: int,
    chunk_bytes: int,
    scale: float = 0.0,
    transfer: Rate = UNKNOWN,
    held_tokens: int = 0,
) -> LoadPlan:
    """How many leading chunks to load, for chunks held in ``tiers`` (one name per leading hit).

    ``rates`` are the store's measured read rates by tier name (bytes); ``prefill`` is the engine's
    measured seconds per unit of :func:`prefill_work` (its ``per_s``: units per second);
    ``transfer`` the client's own path per chunk (bytes); ``held_tokens`` what the engine has
    computed or cached already. See the module docstring for the rule.
    """
    hits = len(tiers)
    if hits == 0:
        return LoadPlan(0, 0)
    if not prefill.known:
        return LoadPlan(hits, hits, reason="no prefill rate")

    def recompute(start_chunk: int) -> float:
        start = max(start_chunk * chunk_tokens, held_tokens)
        return prefill_work(start, hits * chunk_tokens, scale) / prefill.per_s

    # cost[k]: load [0, k) then compute the rest of the hits; the best k is the largest among
    # the cheapest (ties load, as the connector did before).
    loaded = 0.0
    started: set[str] = set()
    costs = [(recompute(0), 0.0)]
    for index, tier in enumerate(tiers):
        if (index + 1) * chunk_tokens > held_tokens:
            rate = rates.get(tier, UNKNOWN)
            if not started:  # the first chunk read: the client's own path starts
                loaded += transfer.latency_s
            if tier not in started:  # one batched read per tier
                started.add(tier)
                loaded += rate.latency_s
            loaded += chunk_bytes / rate.per_s if rate.known else 0.0
            loaded += chunk_bytes / transfer.per_s if transfer.known else 0.0
        costs.append((loaded + recompute(index + 1), loaded))
    best = hits
    for k in range(hits - 1, -1, -1):
        if costs[k][0] < costs[best][0] * (1 - 1e-9):
            best = k
    reason = "loads win"
    if best < hits:
        reason = f"recomputing beats loading from {tiers[best]} (chunk {best})"
    return LoadPlan(
        load=best,
        hits=hits,
        load_s=costs[best][1],
        recompute_s=recompute(best),
        all_load_s=costs[hits][1],
        all_recompute_s=recompute(0),
        reason=reason,
    )
