"""``kvstore stats``: a server's tier usage and counters, once or as a live view (``--watch``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvstore.cli.targets import nothing_answers
from kvstore.config import format_size
from kvstore.errors import DeadlineExceededError, StoreUnavailableError

__all__ = ["format_stats", "watch"]

# Columns of the tier table; the detail line under it shows each tier's other numbers.
_TABLE = ("used", "capacity", "blocks", "hits", "evictions")
# Counters of misses by reason (``miss_absent``...; see kvstore.store.counters.MISS_REASONS).
_MISS = "miss_"
# The order reasons are shown in (kvstore.store.counters.MISS_REASONS; unknown ones after).
_REASONS = ("absent", "evicted", "corrupt", "tier_down", "deadline", "denied", "namespace")


def _reason_order(reason: str) -> tuple[int, str]:
    return (_REASONS.index(reason) if reason in _REASONS else len(_REASONS), reason)


# Cleared screen, cursor home: a terminal shows one frame at a time.
_CLEAR = "\x1b[H\x1b[2J"


def _rate(name: str, now: dict[str, Any], before: dict[str, Any] | None, seconds: float) -> str:
    """`` (+N/s)`` since the previous frame, for a counter that changed; empty otherwise."""
    if before is None or seconds <= 0:
        return ""
    delta = now.get(name, 0) - before.get(name, 0)
    return f" ({delta / seconds:+.1f}/s)" if isinstance(delta, int | float) and delta else ""


def format_stats(
    stats: dict[str, Any], previous: dict[str, Any] | None = None, seconds: float = 0.0
) -> list[str]:
    """The lines of the stats table; with the ``previous`` stats taken ``seconds`` earlier,
    counters that moved show their rate per second."""
    lines = [
        f"{'tier':<8}{'used':>14}{'capacity':>14}{'blocks':>10}{'hits':>10}{'hit rate':>10}"
        f"{'evictions':>11}"
    ]
    before_tiers = (previous or {}).get("tiers", {})
    counters = stats["counters"]
    misses = {k[len(_MISS) :]: v for k, v in counters.items() if k.startswith(_MISS)}
    misses = dict(sorted(misses.items(), key=lambda item: _reason_order(item[0])))
    # As the dashboard computes it: a tier's hits over every key asked for (hits in any tier
    # plus misses for any reason), so the tiers' rates add up to the overall hit rate.
    asked = sum(tier.get("hits", 0) for tier in stats["tiers"].values()) + sum(misses.values())
    for name, tier in stats["tiers"].items():
        before = before_tiers.get(name) if previous is not None else None
        rate = f"{100 * tier.get('hits', 0) / asked:.1f}%" if asked else "-"
        lines.append(
            f"{name:<8}{format_size(tier.get('used', 0)):>14}"
            f"{format_size(tier.get('capacity', 0)):>14}{tier.get('blocks', 0):>10}"
            f"{tier.get('hits', 0):>10}{rate:>10}{tier.get('evictions', 0):>11}"
            + "".join(
                f"  {key}{_rate(key, tier, before, seconds)}"
                for key in ("hits", "evictions")
                if _rate(key, tier, before, seconds)
            )
        )
    prev_counters = (previous or {}).get("counters") if previous is not None else None

    def counter(name: str, label: str) -> str:
        return f"{label} {counters.get(name, 0)}{_rate(name, counters, prev_counters, seconds)}"

    if misses:
        lines.append(
            "misses by reason: "
            + "  ".join(counter(f"{_MISS}{reason}", reason) for reason in misses)
        )
    lines.extend(_server_lines(stats))
    lines.append(
        f"blocks {stats['blocks']}  {counter('hits', 'hits')}  {counter('misses', 'misses')}  "
        f"{counter('evicted_from_store', 'evicted')}"
    )
    for name, tier in stats["tiers"].items():
        extra = {k: v for k, v in tier.items() if k not in _TABLE}
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
    return lines


def _server_lines(stats: dict[str, Any]) -> list[str]:
    """The shared tier, the prefetch queue and the shared-memory server, where they exist."""
    counters = stats["counters"]
    lines = []
    shared = stats["tiers"].get("redis")
    if shared is not None:
        state = "up" if shared.get("up") else "DOWN"
        if shared.get("down_nodes"):
            state += f" ({shared['down_nodes']} cluster node(s) down)"
        lines.append(
            f"shared tier: {state}  "
            f"backlog {format_size(counters.get('shared_write_backlog_bytes', 0))}  "
            f"re-send queue {counters.get('shared_write_queue_blocks', 0)} blocks  "
            f"not shared {counters.get('write_through_dropped', 0)}  "
            f"reconnects {shared.get('reconnects', 0)}"
        )
    mismatched = counters.get("keyring_mismatched_nodes", 0)
    if mismatched:
        state = "OFF: " if shared is None else ""
        lines.append(
            f"shared tier: {state}integrity keyring shares no secret with {mismatched} node(s) "
            "on it (set the same integrity.secrets everywhere; see the server's log)"
        )
    if "prefetch_queued_keys" in counters:
        outcomes = "  ".join(
            f"{name} {counters.get(f'prefetch_keys_{name}', 0)}"
            for name in ("ready", "missing", "failed")
        )
        lines.append(
            f"prefetch: queued keys {counters['prefetch_queued_keys']}  {outcomes}  "
            f"cancelled {counters.get('prefetch_cancelled', 0)}"
        )
    if "shm_connections" in counters:
        lines.append(
            f"shm: connections {counters['shm_connections']}  leases "
            f"{counters.get('shm_leases', 0)}  reservations {counters.get('shm_reservations', 0)}"
        )
    return lines


def watch(
    fetch: Callable[[], dict[str, Any]],
    every_s: float,
    target: str,
    out: TextIO = sys.stdout,
) -> None:
    """Print a frame of :func:`format_stats` every ``every_s`` seconds until interrupted
    (KeyboardInterrupt propagates: the caller ends quietly). Rates are per second since the
    frame before; on a terminal each frame replaces the last. A server that does not answer
    (not started yet, restarting) gets a frame saying so, and the watch goes on: a live view is
    what one keeps open across a restart."""
    previous: dict[str, Any] | None = None
    taken = time.monotonic()
    clear = out.isatty()
    while True:
        header = (
            f"kvstore stats {target} at {time.strftime('%H:%M:%S')} "
            f"(every {every_s:g}s; Ctrl-C stops)"
        )
        try:
            stats = fetch()
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            # Rates restart with the next answer: a restarted server's counters start at 0.
            previous = None
            lines = [header, nothing_answers(target, exc), "waiting; retrying each refresh"]
            out.write((_CLEAR if clear else "") + "\n".join(lines) + "\n\n")
            out.flush()
            time.sleep(every_s)
            continue
        now = time.monotonic()
        lines = [header, *format_stats(stats, previous, now - taken)]
        out.write((_CLEAR if clear else "") + "\n".join(lines) + "\n\n")
        out.flush()
        previous, taken = stats, now
        time.sleep(every_s)
