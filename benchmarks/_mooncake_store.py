"""Mooncake Store between two processes over its TCP transport: the baseline issue 40 names.

Mooncake Store needs its own interpreter here (``mooncake-transfer-engine-non-cuda`` from PyPI;
the CUDA build needs ``libcuda``, and both need ``libibverbs1`` from the system), so this module
runs as a script under that interpreter, in three roles:

* :func:`mooncake_store` (called from ``bench_ucx_wire.py``, any interpreter) starts
  ``mooncake_master`` with its HTTP metadata server on free ports, a *holder* process that mounts
  a 2 GiB segment (where the blocks live: the other side of the wire), and the *bench* process,
  which mounts a minimal segment of its own, registers one staging buffer, and times
  ``batch_put_from`` / ``batch_get_into`` of the batches (the zero-copy batch calls);
* ``holder`` and ``bench``: those processes.

Bytes are checked once per case (a get of what was put). One sample is one batch call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["mooncake_store"]

_SEGMENT = 2 * 1024**3
_WARMUP = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mooncake_store(
    python: str, cases: dict[str, tuple[int, int, int]]
) -> dict[str, dict[str, list[float]]] | str:
    """Seconds per batch call (``put`` / ``get``) per ``label: (block bytes, batch, reps)``, or
    why Mooncake Store could not run (a string)."""
    if not Path(python).exists():
        return f"no interpreter with Mooncake Store at {python}"
    master = Path(python).parent / "mooncake_master"
    if not master.exists():
        return f"no mooncake_master beside {python}"
    rpc, http = _free_port(), _free_port()
    spec = {
        "metadata": f"http://127.0.0.1:{http}/metadata",
        "master": f"127.0.0.1:{rpc}",
        "cases": cases,
    }
    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory() as logs:
        procs: list[subprocess.Popen[Any]] = []
        try:
            procs.append(
                subprocess.Popen(
                    [
                        str(master),
                        f"--rpc_port={rpc}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_port={http}",
                        "--http_metadata_server_host=127.0.0.1",
                    ],
                    stdout=open(Path(logs) / "master.log", "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                )
            )
            time.sleep(2.0)  # the master binds its ports
            holder = subprocess.Popen(
                [python, script, "holder", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(Path(logs) / "holder.log", "w"),  # noqa: SIM115
                text=True,
            )
            procs.append(holder)
            assert holder.stdout is not None
            if holder.stdout.readline().strip() != "ready":
                return "Mooncake holder did not start: " + (Path(logs) / "holder.log").read_text()
            bench = subprocess.run(
                [python, script, "bench", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if bench.returncode != 0:
                return f"Mooncake bench failed: {bench.stderr[-2000:]}"
            result: dict[str, dict[str, list[float]]] = json.loads(bench.stdout.splitlines()[-1])
            return result
        finally:
            for proc in reversed(procs):
                proc.kill()
                proc.wait()


def _store(spec: dict[str, Any], segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        "127.0.0.1", spec["metadata"], segment, 64 * 1024**2, "tcp", "", spec["master"]
    )
    if code != 0:
        raise RuntimeError(f"Mooncake setup failed: {code}")
    return store


def _hold(spec: dict[str, Any]) -> None:
    store = _store(spec, _SEGMENT)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent goes
    store.close()


def _bench(spec: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    import numpy as np

    store = _store(spec, 0)  # no segment of its own: every block lives in the holder
    out: dict[str, dict[str, list[float]]] = {}
    rng = np.random.default_rng(0)
    for label, (size, batch, reps) in spec["cases"].items():
        source = rng.integers(0, 256, size * batch, dtype=np.uint8)
        target = np.zeros_like(source)
        for buffer in (source, target):
            if store.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        sizes = [size] * batch
        puts, gets = [], []
        for rep in range(_WARMUP + reps):
            keys = [f"{label}-{rep}-{i}-{os.getpid()}" for i in range(batch)]
            ptrs = [source.ctypes.data + i * size for i in range(batch)]
            started = time.perf_counter()
            codes = store.batch_put_from(keys, ptrs, sizes)
            put_s = time.perf_counter() - started
            if any(code != 0 for code in codes):
                raise RuntimeError(f"batch_put_from: {codes}")
            targets = [target.ctypes.data + i * size for i in range(batch)]
            started = time.perf_counter()
            got = store.batch_get_into(keys, targets, sizes)
            get_s = time.perf_counter() - started
            if list(got) != sizes:
                raise RuntimeError(f"batch_get_into: {list(got)}")
            if rep == 0 and not np.array_equal(source, target):
                raise RuntimeError("Mooncake returned other bytes")
            for key in keys:
                store.remove(key)
            if rep >= _WARMUP:
                puts.append(put_s)
                gets.append(get_s)
        for buffer in (source, target):
            store.unregister_buffer(buffer.ctypes.data)
        out[label] = {"put": puts, "get": gets}
    store.close()
    return out


if __name__ == "__main__":
    role, argument = sys.argv[1], json.loads(sys.argv[2])
    if role == "holder":
        _hold(argument)
    else:
        print(json.dumps(_bench(argument)), flush=True)
