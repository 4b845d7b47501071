"""One load process of the soak (:mod:`soak`): puts and gets against one ``kvstore serve``.

Run by the soak itself (``python benchmarks/_soak_worker.py TARGET PLANE SEED END STATS``), never
by hand. Until the wall-clock instant ``END`` it loops (one bounded batch per iteration): a put of
``--batch`` blocks chosen among the newest ids of a sliding window, or a get of ``--batch`` blocks
chosen anywhere in the window. Ids come from the clock (:func:`live_ids`), so every worker of
every node works on the same key space without talking to the others: a get finds blocks that
any worker stored on any node (through the shared Redis tier), and old ids fall out of the window
and age out of the tiers (churn). A block's bytes follow from its key (:func:`value_of`), so every
byte a get returns is checked; a block that differs is a wrong block, counted with its bytes.

Calls are paced to ``--ops-per-s`` at most. Every ``--flush-s`` seconds it appends one JSON line
to ``STATS``: counts since the last line and the latencies (ms) of the calls that ended in that
span; a killed worker loses at most that.
Errors (a server restarting, a Redis failover) are counted, never fatal: the worker backs off
for a moment and goes on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

from kvstore import KVStoreClient, KVStoreError, Namespace

NAMESPACE = Namespace(model="soak", num_layers=2, num_kv_heads=2, head_size=64)
#: Block sizes, by id: enough variety that pages of several sizes churn through the arena.
SIZES = (32 << 10, 64 << 10, 128 << 10, 192 << 10)


def key_of(block_id: int) -> bytes:
    """The 16-byte key of block ``block_id``."""
    return hashlib.blake2b(b"soak:%d" % block_id, digest_size=16).digest()


def value_of(block_id: int) -> bytes:
    """The payload of block ``block_id``: its key repeated (a block served under another key,
    torn or shifted shows at once)."""
    size = SIZES[block_id % len(SIZES)]
    key = key_of(block_id)
    return (key * (size // len(key) + 1))[:size]


def live_ids(now: float, rate: float, window_s: float) -> tuple[int, int]:
    """The ids alive at ``now``: ``rate`` new ids a second, each alive ``window_s`` seconds."""
    newest = int(now * rate)
    return max(0, newest - int(window_s * rate)), newest


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("plane", choices=["shm", "grpc"])
    parser.add_argument("seed", type=int)
    parser.add_argument("end", type=float, help="wall-clock instant (time.time()) to stop at")
    parser.add_argument("stats", type=Path)
    parser.add_argument("--rate", type=float, default=40.0, help="new ids per second")
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--flush-s", type=float, default=2.0)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--ops-per-s", type=float, default=10.0, help="calls a second at most")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    counts = _fresh()
    latencies: dict[str, list[float]] = {"get": [], "put": []}
    last_flush = time.monotonic()
    client = KVStoreClient(
        args.target, namespace=NAMESPACE, timeout=args.timeout_s, data_plane=args.plane
    )
    next_call = time.monotonic()
    with args.stats.open("a") as stats:
        while time.time() < args.end:
            # Paced, not flat out: the soak is about time, not throughput (and the machine is
            # shared); a call that ran late does not make the next ones hurry.
            next_call = max(next_call + 1 / args.ops_per_s, time.monotonic())
            time.sleep(max(0.0, next_call - time.monotonic()))
            now = time.time()
            low, high = live_ids(now, args.rate, args.window_s)
            putting = rng.random() < 0.4
            if putting:  # the newest ten seconds of ids: most are new, some already stored
                start = max(low, high - int(10 * args.rate))
                ids = sorted({rng.randint(start, high) for _ in range(args.batch)})
            else:
                ids = sorted({rng.randint(low, high) for _ in range(args.batch)})
            keys = [key_of(i) for i in ids]
            began = time.perf_counter()
            try:
                if putting:
                    client.put(keys, [value_of(i) for i in ids])
                    counts["puts"] += 1
                    counts["put_bytes"] += sum(SIZES[i % len(SIZES)] for i in ids)
                else:
                    got = client.get(keys)
                    counts["gets"] += 1
                    for block_id, value in zip(ids, got, strict=True):
                        if value is None:
                            counts["misses"] += 1
                        elif value != value_of(block_id):
                            counts["wrong_blocks"] += 1
                            counts["wrong_bytes"] += len(value)
                        else:
                            counts["hits"] += 1
                            counts["get_bytes"] += len(value)
                latencies["put" if putting else "get"].append((time.perf_counter() - began) * 1e3)
            except KVStoreError as exc:
                counts["errors"] += 1
                counts.setdefault("error_kinds", {})
                kind = type(exc).__name__
                counts["error_kinds"][kind] = counts["error_kinds"].get(kind, 0) + 1
                time.sleep(0.1)  # a restarting server or a failover: try again shortly
            if time.monotonic() - last_flush >= args.flush_s:
                stats.write(json.dumps({"t": time.time(), **counts, **_lat(latencies)}) + "\n")
                stats.flush()
                counts, latencies = _fresh(), {"get": [], "put": []}
                last_flush = time.monotonic()
        stats.write(json.dumps({"t": time.time(), **counts, **_lat(latencies)}) + "\n")
    client.close()


def _fresh() -> dict:  # type: ignore[type-arg]
    return dict.fromkeys(
        ("puts", "gets", "hits", "misses", "errors", "wrong_blocks", "wrong_bytes"), 0
    ) | {"put_bytes": 0, "get_bytes": 0}


def _lat(latencies: dict[str, list[float]]) -> dict[str, list[float]]:
    return {f"{op}_ms": [round(v, 3) for v in values] for op, values in latencies.items()}


if __name__ == "__main__":
    main()
