"""The reading side of benchmarks/bench_peer.py, run inside the reading host's network namespace.

Reads a JSON spec on stdin: ``rounds``, a list of rounds, each a list of cases
``{"name", "target", "keys": [hex...], "digests": [hex...], "batch"}``; ``namespace``: the
:class:`kvstore.Namespace` fields; ``data_plane``. For every case of a round (in the order given,
which the parent rotates) it gets the keys from ``target`` in batches of ``batch``, checks each
payload's BLAKE2b digest (a wrong or missing block fails the run: its timing would mean nothing)
and records the seconds of the gets (not for a case marked ``warmup``). Prints
``{"seconds": {name: [per round]}, "bytes": {...}, "planes": {...}}`` as JSON on stdout.
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
        for case in cases:
            name = case["name"]
            client = clients.get(name)
            if client is None:
                client = KVStoreClient(
                    case["target"],
                    namespace=namespace,
                    timeout=float(spec["timeout_s"]),
                    data_plane=spec["data_plane"],
                )
                client.lookup([b"\0" * 16])  # connect (and attach shared memory) untimed
                clients[name] = client
            keys = [bytes.fromhex(k) for k in case["keys"]]
            digests = case["digests"]
            batch = int(case["batch"])
            total = 0
            got: list[Any] = []
            start = time.perf_counter()
            for first in range(0, len(keys), batch):
                got.extend(client.get(keys[first : first + batch]))
            elapsed = time.perf_counter() - start
            for index, payload in enumerate(got):
                if payload is None:
                    raise SystemExit(f"{name}: block {index} missing")
                if hashlib.blake2b(payload, digest_size=16).hexdigest() != digests[index]:
                    raise SystemExit(f"{name}: block {index} differs")
                total += len(payload)
            if case.get("warmup"):
                continue
            seconds.setdefault(name, []).append(elapsed)
            moved.setdefault(name, []).append(total)
            planes[name] = client.data_plane
    for client in clients.values():
        client.close()
    json.dump({"seconds": seconds, "bytes": moved, "planes": planes}, sys.stdout)


if __name__ == "__main__":
    main()
