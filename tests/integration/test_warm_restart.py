"""A server SIGKILLed in the middle of a stream of writes restarts with only intact blocks.

A separate writer process puts batches as fast as it can and prints each batch the server
acknowledged. The server is killed mid-stream, restarted on the same nvme directory, and every
key is read back: acknowledged blocks must all be there, bit-identical (with no dram tier every
acknowledged put was committed to LMDB, and a killed process loses nothing committed); blocks
of the batch in flight may or may not be there, but never with wrong bytes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import numpy as np

from kvstore import ChunkHasher, KVStoreClient, Namespace

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

NS = Namespace(model="warm-restart", num_layers=2, num_kv_heads=2, head_size=64)
BLOCK = 64 * 1024
BATCH = 4
BATCHES = 400

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvstore import ChunkHasher, KVStoreClient, KVStoreError, Namespace

    ns = Namespace(model="warm-restart", num_layers=2, num_kv_heads=2, head_size=64)
    keys = ChunkHasher(chunk_size=8, namespace=ns).keys(list(range({total})))
    client = KVStoreClient(sys.argv[1], namespace=ns, timeout=5)
    for batch in range({batches}):
        chunk = keys[batch * {batch_size} : (batch + 1) * {batch_size}]
        values = [np.random.default_rng(batch * {batch_size} + i).bytes({block})
                  for i in range(len(chunk))]
        try:
            client.put(chunk, values)
        except KVStoreError:
            break
        print(batch, flush=True)
    """
).format(total=8 * BATCH * BATCHES, batches=BATCHES, batch_size=BATCH, block=BLOCK)


def expected(index: int) -> bytes:
    return np.random.default_rng(index).bytes(BLOCK)


def test_sigkill_in_the_middle_of_writes_keeps_only_intact_blocks(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="0", nvme_capacity="256MiB")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, server.target], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    acknowledged = -1
    deadline = time.monotonic() + 60
    while acknowledged < 30 and time.monotonic() < deadline:
        line = writer.stdout.readline()
        if not line:
            break
        acknowledged = int(line)
    assert acknowledged >= 30, "the writer did not get going"
    server.kill()  # SIGKILL while the writer keeps putting
    rest, _ = writer.communicate(timeout=60)
    for line in rest.split():
        acknowledged = max(acknowledged, int(line))
    assert writer.returncode == 0
    assert acknowledged < BATCHES - 1, "the server died only after the last write"

    server.start()
    keys = ChunkHasher(chunk_size=8, namespace=NS).keys(list(range(8 * BATCH * BATCHES)))
    with KVStoreClient(server.target, namespace=NS, timeout=30) as client:
        got: list[bytes | None] = []
        for start in range(0, len(keys), 256):
            got.extend(client.get(keys[start : start + 256]))
        for index, value in enumerate(got):
            if index < (acknowledged + 1) * BATCH:
                assert value == expected(index), f"acknowledged block {index} lost or changed"
            elif value is not None:
                assert value == expected(index), f"block {index} came back with wrong bytes"
        assert client.stats()["tiers"]["nvme"]["corrupt_blocks"] == 0
    server.stop(signal.SIGTERM)
