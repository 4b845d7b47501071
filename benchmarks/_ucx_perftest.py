"""``ucx_perftest``, UCX's own C benchmark, as the ceiling of the UCX data path.

The binary ships in the ``libucx`` wheel that ucxx depends on, and runs only with that wheel's
``lib`` directory on ``LD_LIBRARY_PATH``; :func:`perftest_binary` finds both. :func:`perftest` runs
``ucx_perftest -t tag_bw`` between two processes over loopback with the UCX settings the Python path
uses (``kvstore.protocol.ucx.UCX_ENV_DEFAULTS``) and one ``UCX_TLS``. It reports MB/s with
MB = 2**20; this module converts to GB = 10**9 bytes like every other figure.

``error_handling`` (perftest's ``-e``) is the mode every kvstore and ucxx endpoint runs in (peer
failure detection: a dead peer fails its operations instead of hanging them). It changes what UCX
can do over TCP: with it UCX 1.21 sends large messages as multi-fragment eager copies on one
interface; without it, as rendezvous zero-copy writes, also over a second interface ("rails"),
1.6-2.6x as fast here. So the ``-e`` figure is the ceiling for the same transport in the same
mode; the other shows what dropping peer-failure detection would be worth.

``hosts`` runs the two sides on two "hosts" (``tests/harness/netns_hosts.py``: network namespaces
on a bridge), the server on the first, the client on the second, over the bridge.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from _common import GB, free_port, launchers, reap

from kvstore.protocol.ucx import UCX_ENV_DEFAULTS

__all__ = ["perftest", "perftest_binary"]

_FINAL = re.compile(r"^Final:\s+(.*)$", re.MULTILINE)
_MIB = 1024**2


def perftest_binary() -> tuple[Path, dict[str, str]] | None:
    """``ucx_perftest`` from the libucx wheel ucxx uses, and the environment it needs."""
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    library_path = os.pathsep.join(
        filter(None, [str(root / "lib"), os.environ.get("LD_LIBRARY_PATH")])
    )
    settings = {name: os.environ.get(name, value) for name, value in UCX_ENV_DEFAULTS.items()}
    return binary, {"LD_LIBRARY_PATH": library_path, **settings}


def perftest(
    binary: Path,
    env: dict[str, str],
    tls: str,
    size: int,
    iters: int,
    *,
    error_handling: bool = True,
    hosts: tuple[Any, Any] | None = None,
) -> float:
    """``ucx_perftest -t tag_bw`` between two processes over loopback; GB/s (10**9), overall.
    ``error_handling``: endpoints with peer-failure detection (``-e``), as kvstore's. ``hosts``:
    ``(server's, client's)``, each with ``popen``, ``run`` and ``address`` (a
    ``harness.netns_hosts.Host``), instead of this host's loopback."""
    port = free_port()
    run_env = {**os.environ, **env, "UCX_TLS": tls}
    popen, run, address = launchers(hosts)
    server = popen(
        [str(binary), "-p", str(port)],
        env=run_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)  # the server binds its out-of-band socket
        client = [str(binary), address, "-p", str(port), "-t", "tag_bw"]
        result = run(
            [*client, "-s", str(size), "-n", str(iters), *(["-e"] if error_handling else [])],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        reap(server)
    match = _FINAL.search(result.stdout)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"ucx_perftest {tls} failed:\n{result.stdout}\n{result.stderr}")
    # iterations, latency 50%/avg/overall (us), bandwidth avg/overall (MB/s), msg rate avg/overall
    return float(match.group(1).split()[5]) * _MIB / GB
