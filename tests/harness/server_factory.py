"""How the integration tests start ``kvstore serve`` processes: a :data:`ServerFactory`
(``factory(*flags, env=..., dram_capacity=..., nvme_capacity=..., settings=..., tenants=...,
nvme_path=..., host=...)``, a :class:`~harness.serve.ServerProcess` started) made by
:func:`servers_in`, which ``tests/integration/conftest.py``'s fixtures hand out, and the
namespace their clients use by default (:data:`NAMESPACE`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from harness.netns_hosts import Host
from harness.serve import ServerProcess
from kvstore import Namespace

#: The namespace the ``client`` fixture (and ``ServerProcess.client``) uses.
NAMESPACE = Namespace(model="integration-test", num_layers=2, num_kv_heads=2, head_size=64)

__all__ = ["NAMESPACE", "ServerFactory", "servers_in"]

ServerFactory = Callable[..., ServerProcess]


@contextlib.contextmanager
def servers_in(root: Path) -> Iterator[ServerFactory]:
    """A :data:`ServerFactory` whose servers live under ``root``, each killed at the end if
    still running."""
    started: list[ServerProcess] = []

    def start(
        *flags: str,
        env: Mapping[str, str] | None = None,
        dram_capacity: str = "64MiB",
        nvme_capacity: str = "64MiB",
        nvme_path: Path | None = None,
        host: Host | None = None,
        settings: Mapping[str, Any] | None = None,
        tenants: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> ServerProcess:
        sizes = {"dram.capacity": dram_capacity, "nvme.capacity": nvme_capacity}
        process = ServerProcess(
            root / f"server-{len(started)}",
            flags,
            env,
            settings={**sizes, **(settings or {})},
            tenants=tenants,
            nvme_path=nvme_path,
            host=host,
            namespace=NAMESPACE,
        )
        started.append(process)
        return process.start()

    try:
        yield start
    finally:
        for process in started:
            process.close()
