"""The scheduler half's load-or-recompute decision, with the figures it is made from.

:class:`LoadDecider` keeps the inputs of :func:`kvstore.client.cost_model.plan_loads` up to date and
asks it, per request, how many of the leading stored chunks to load:

- **the store's tiers**: the rate each tier (and ``peer``) serves reads at, as the store measures
  it (``read_bytes_per_s`` / ``read_latency_us`` in ``kvstore stats``); the scheduler refreshes
  them from the store's ``Stats`` every :data:`RATES_REFRESH_S` in the background;
- **the client's own path**: the workers' batched gets per step (bytes loaded over seconds, as
  they report them in the connector's statistics). It is measured end to end, so a get that
  made the store read a lower tier counts that tier's time too: a slow tier is weighed a little
  pessimistically;
- **the engine's prefill**: the scheduler times each step from the plan it hands the workers
  (``build_connector_meta``) to the step's output (``update_connector_output``), and divides the
  step's prefill work (:func:`~kvstore.client.cost_model.prefill_work` of every request's
  scheduled tokens after its context) by it, the step's loads left out. A step's fixed cost
  shows as the fit's latency and is left out of recompute estimates (a step runs whether or not
  a chunk is loaded); until the steps' sizes vary enough to fit a line, the rate is their mean,
  fixed cost included, which leans towards loading.

Until a figure is measured the decision loads, as the connector did before it existed.
``load_policy`` ``always`` / ``never`` bypass it. One DEBUG log line per decision that loads
everything, INFO per decision that declines chunks, with its inputs.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.client.cost_model import LoadPlan, plan_loads
from kvstore.integrations.vllm.common import EngineShape
from kvstore.protocol.rates import UNKNOWN, Rate, RateMeter, rate_from_stats

__all__ = ["RATES_REFRESH_S", "LoadDecider", "dtype_bytes", "hidden_size", "token_bytes"]

logger = logging.getLogger(__name__)

#: How often the scheduler asks the store for its tiers' measured rates.
RATES_REFRESH_S = 2.0
# Steps planned and not yet reported done; more means outputs are being lost: start afresh.
_MAX_IN_FLIGHT = 4
# The ``Stats`` counters suffix a remote source's (peer's) rate rides under.
_PEER_SUFFIX = "_read_bytes_per_s"


def token_bytes(shape: EngineShape) -> int:
    """KV bytes of one token on this rank (keys and values of every layer)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * dtype_bytes(shape.dtype)


def hidden_size(vllm_config: Any) -> int:
    """The model's hidden size, for the attention share of prefill cost (0: unknown, not
    weighed). Read duck-typed, like the rest of the configuration."""
    model = getattr(vllm_config, "model_config", None)
    try:
        return int(model.get_hidden_size()) if model is not None else 0
    except (AttributeError, TypeError, ValueError):
        return 0


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named like torch's (``bfloat16`` 2, ``float8_e4m3fn`` 1)."""
    bits = re.search(r"\d+", dtype)
    return max(int(bits.group()) // 8, 1) if bits else 2


class LoadDecider:
    """Per request, how many leading stored chunks to load (see the module docstring)."""

    def __init__(
        self,
        policy: str,
        *,
        chunk_tokens: int,
        chunk_bytes: int,
        scale: float,
    ) -> None:
        """``chunk_bytes``: one chunk as this rank stores it; ``scale``: the context scale of
        :func:`~kvstore.client.cost_model.prefill_work` (0: attention is not weighed)."""
        self.policy = policy
        self._chunk_tokens = chunk_tokens
        self._chunk_bytes = chunk_bytes
        self._scale = scale
        self._lock = threading.Lock()
        self._tiers: dict[str, Rate] = {}
        self._prefill = RateMeter()
        self._transfer = RateMeter()
        self._steps: deque[tuple[float, float]] = deque()  # (planned at, work) per step
        self._last_end = 0.0
        self._rates_at = -RATES_REFRESH_S

    # -- inputs ------------------------------------------------------------------------------

    def rates_due(self, now: float) -> bool:
        """Whether the tiers' rates are due a refresh (and, if so, mark it begun)."""
        if self.policy != "cost" or now - self._rates_at < RATES_REFRESH_S:
            return False
        self._rates_at = now
        return True

    def take_store_stats(self, stats: Mapping[str, Any]) -> None:
        """Keep the tiers' (and peers') measured read rates from a ``Stats`` answer."""
        tiers = {
            name: rate_from_stats(values) for name, values in (stats.get("tiers") or {}).items()
        }
        counters = stats.get("counters") or {}
        for key in counters:
            if key.endswith(_PEER_SUFFIX):  # a remote source's: peer_read_bytes_per_s
                name = key.removesuffix(_PEER_SUFFIX)
                prefix = f"{name}_"
                tiers[name] = rate_from_stats(
                    {k.removeprefix(prefix): v for k, v in counters.items() if k.startswith(prefix)}
                )
        with self._lock:
            self._tiers = tiers

    def step_planned(self, work: float, now: float) -> None:
        """A step with ``work`` prefill units was handed to the workers at ``now``."""
        with self._lock:
            if len(self._steps) >= _MAX_IN_FLIGHT:
                self._steps.clear()
            self._steps.append((now, work))

    def step_done(self, now: float, load_s: float = 0.0) -> None:
        """The oldest step planned reported its output at ``now``, after ``load_s`` of loads in
        it (not prefill: left out). With asynchronous scheduling a step is planned while the one
        before runs: it starts when that one ends."""
        with self._lock:
            if not self._steps:
                return
            planned, work = self._steps.popleft()
            started = max(planned, self._last_end)
            self._last_end = now
            self._prefill.add(work, now - started - load_s)

    def loads_done(self, nbytes: int, seconds: float) -> None:
        """The workers loaded ``nbytes`` in ``seconds`` in one step."""
        with self._lock:
            self._transfer.add(nbytes, seconds)

    def inputs(self) -> dict[str, Any]:
        """The figures a decision is made from (logged with it; for tests and debugging)."""
        with self._lock:
            return {
                "tiers": dict(self._tiers),
                "prefill": self._prefill.rate(),
                "transfer": self._transfer.rate(),
            }

    # -- the decision ------------------------------------------------------------------------

    def decide(self, request_id: str, tiers: Sequence[str], held_tokens: int) -> LoadPlan:
        """The plan for a request whose leading stored chunks are in ``tiers``; ``held_tokens``
        the engine has already (its own prefix cache)."""
        hits = len(tiers)
        if self.policy == "always":
            return LoadPlan(hits, hits, reason="load_policy always")
        if self.policy == "never":
            return LoadPlan(0, hits, reason="load_policy never")
        with self._lock:
            rates, prefill, transfer = (
                dict(self._tiers),
                self._prefill.rate(),
                self._transfer.rate(),
            )
        # Recompute estimates leave the per-step latency out (see the module docstring).
        prefill = Rate(prefill.per_s) if prefill.known else UNKNOWN
        plan = plan_loads(
            tiers,
            rates,
            prefill,
            chunk_tokens=self._chunk_tokens,
            chunk_bytes=self._chunk_bytes,
            scale=self._scale,
            transfer=transfer,
            held_tokens=held_tokens,
        )
        level = logging.INFO if plan.declined else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(
                level,
                "kvstore load plan %s: load %d of %d stored chunks (%s); expected load %.2f ms + "
                "recompute %.2f ms, against %.2f ms loading all, %.2f ms computing all; tiers %s, "
                "transfer %s, prefill %.0f units/s",
                request_id,
                plan.load,
                plan.hits,
                plan.reason,
                plan.load_s * 1e3,
                plan.recompute_s * 1e3,
                plan.all_load_s * 1e3,
                plan.all_recompute_s * 1e3,
                _tier_summary(tiers, rates),
                _rate_text(transfer),
                prefill.per_s,
            )
        return plan


def _rate_text(rate: Rate) -> str:
    if not rate.known:
        return "unmeasured"
    return f"{rate.per_s / 1e6:,.1f} MB/s + {rate.latency_s * 1e3:.2f} ms"


def _tier_summary(tiers: Sequence[str], rates: Mapping[str, Rate]) -> str:
    counts: dict[str, int] = {}
    for tier in tiers:
        counts[tier] = counts.get(tier, 0) + 1
    return ", ".join(
        f"{name} x{count} at {_rate_text(rates.get(name, UNKNOWN))}"
        for name, count in counts.items()
    )
