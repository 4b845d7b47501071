"""The reading side of benchmarks/bench_peer.py, run inside the reading host's network namespace.

Reads a JSON spec on stdin: ``rounds``, a list of rounds, each a list of cases
``{"name", "target", "keys": [hex...], "digests": [hex...], "batch"}``; ``namespace``: the
:class:`kvstore.Namespace` fields; ``data_plane``. For every round it gets each case's keys
from its ``target`` in batches of ``batch``, batch by batch across the cases (in the order
given, which the parent rotates), checks each payload's BLAKE2b digest (a wrong or missing
block fails the run: its timing would mean nothing) and records the seconds of the gets (not
for a case marked ``warmup``). Prints ``{"seconds": {name: [per round]}, "bytes": {...},
"planes": {...}}`` as JSON on stdout.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

from kvstore import KVStoreClient, Namespace


def main() -> None:
    spec = json.load(sys.stdin)
    namespace = Namespace(**spec["namespace"])
    clients: dict[str, KVStoreClient] = {}
    seconds: dict[str, list[float]] = {}
    moved: dict[str, list[int]] = {}
    planes: dict[str, str] = {}
    for cases in spec["rounds"]:
        # Batch by batch across the cases (lockstep): on a shared machine, every path then
        # meets the same background load, which a path-after-path order would not give it.
        elapsed: dict[str, float] = {}
        got: dict[str, list[Any]] = {}
        keys = {case["name"]: [bytes.fromhex(k) for k in case["keys"]] for case in cases}
        for case in cases:
            name = case["name"]
            if name not in clients:
                clients[name] = KVStoreClient(
                    case["target"],
                    namespace=namespace,
                    timeout=float(spec["timeout_s"]),
                    data_plane=spec["data_plane"],
                )
                clients[name].lookup([b"\0" * 16])  # connect (attach shared memory) untimed
            elapsed[name], got[name] = 0.0, []
        longest = max(len(k) for k in keys.values())
        for first in range(0, longest, max(int(case["batch"]) for case in cases)):
            for case in cases:
                name, batch = case["name"], int(case["batch"])
                wanted = keys[name][first : first + batch]
                if not wanted:
                    continue
                start = time.perf_counter()
                got[name].extend(clients[name].get(wanted))
                elapsed[name] += time.perf_counter() - start
        for case in cases:
            name = case["name"]
            total = 0
            for index, payload in enumerate(got[name]):
                if payload is None:
                    raise SystemExit(f"{name}: block {index} missing")
                if hashlib.blake2b(payload, digest_size=16).hexdigest() != case["digests"][index]:
                    raise SystemExit(f"{name}: block {index} differs")
                total += len(payload)
            if case.get("warmup"):
                continue
            seconds.setdefault(name, []).append(elapsed[name])
            moved.setdefault(name, []).append(total)
            planes[name] = clients[name].data_plane
    for client in clients.values():
        client.close()
    json.dump({"seconds": seconds, "bytes": moved, "planes": planes}, sys.stdout)


if __name__ == "__main__":
    main()
