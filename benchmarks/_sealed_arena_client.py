"""One client run of :mod:`bench_sealed_arena`, with whatever kvstore is on its ``PYTHONPATH``.

``python benchmarks/_sealed_arena_client.py TARGET SIZES_KIB BATCH REPS``: for each block
size, ``REPS`` timed calls of ``put`` (fresh keys, deleted untimed), ``get_into`` (direct index
reads), ``get_into leased`` (a second client with direct reads off) and ``lease`` (zero-copy
views), every byte checked; prints one JSON line of seconds per call by ``"op size_kib"``. Only
calls that exist on both sides of the comparison are used.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvstore import KVStoreClient, Namespace
from kvstore.client.settings import ClientSettings

NS = Namespace(model="bench-sealed-arena")


def main() -> None:
    target, sizes, batch, reps = sys.argv[1:5]
    timings: dict[str, list[float]] = {}
    direct = KVStoreClient(target, namespace=NS, data_plane="shm")
    leased = KVStoreClient(
        target, namespace=NS, data_plane="shm", settings=ClientSettings(shm_direct_reads=False)
    )
    try:
        for size_kib in map(int, sizes.split(",")):
            size = size_kib * 1024
            values = [os.urandom(size) for _ in range(int(batch))]
            stored = [os.urandom(16) for _ in values]
            assert direct.put(stored, values).stored == len(values)
            buffers = [bytearray(size) for _ in values]
            for _ in range(int(reps)):
                keys = [os.urandom(16) for _ in values]
                began = time.perf_counter()
                result = direct.put(keys, values)
                timings.setdefault(f"put {size_kib}", []).append(time.perf_counter() - began)
                assert result.stored == len(values), result
                direct.delete(keys)
                for label, reader in (("get_into", direct), ("get_into leased", leased)):
                    began = time.perf_counter()
                    ok = reader.get_into(stored, buffers)
                    timings.setdefault(f"{label} {size_kib}", []).append(
                        time.perf_counter() - began
                    )
                    assert all(ok) and [bytes(b) for b in buffers] == values, label
                began = time.perf_counter()
                lease = direct.lease(stored)
                assert lease is not None
                views = lease.views
                spent = time.perf_counter() - began
                intact = lease.intact()
                assert all(intact) and all(
                    v is not None and np.array_equal(v, np.frombuffer(value, dtype=np.uint8))
                    for v, value in zip(views, values, strict=True)
                ), "lease"
                lease.release()
                timings.setdefault(f"acquire {size_kib}", []).append(spent)
            direct.delete(stored)
    finally:
        direct.close()
        leased.close()
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
