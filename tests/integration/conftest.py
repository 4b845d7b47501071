"""Fixtures of the integration tests: a real ``kvstore serve`` subprocess on a free loopback port.

Nothing here is mocked. The servers are the harness's :class:`harness.serve.ServerProcess`
(started by :func:`harness.server_factory.servers_in`, where the tests' type hints import
:data:`~harness.server_factory.ServerFactory` from): ``python -m kvstore.cli serve``
on a generated config, with an nvme directory and a temp directory of its own. Fixtures:

* ``server_factory`` / ``module_server_factory``: start servers with given flags and environment;
  every server they started is killed at the end of the test (or module) if still running.
* ``server``: a default server for one test; ``client``: a :class:`KVStoreClient` on it.
* ``data_plane`` (autouse): the plane clients choose through ``KVSTORE_DATA_PLANE``. A test
  marked ``each_plane`` runs twice, on the automatic plane and on gRPC only; any other runs
  once, on the automatic plane (what users get).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.ports import free_port
from harness.redis_server import RedisServer
from harness.serve import ServerProcess
from harness.server_factory import ServerFactory, servers_in

from kvstore import KVStoreClient


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """``server_factory(*flags, env=..., dram_capacity=..., nvme_capacity=..., settings=...,
    tenants=..., nvme_path=..., host=...)`` for one test (see :class:`ServerProcess`)."""
    with servers_in(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_server_factory(
    tmp_path_factory: pytest.TempPathFactory, data_plane: str
) -> Iterator[ServerFactory]:
    """Like ``server_factory``, for servers shared by the tests of one module."""
    with servers_in(tmp_path_factory.mktemp("servers")) as start:
        yield start


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    """A fresh ``kvstore serve`` (64 MiB dram, 64 MiB nvme) for one test."""
    return server_factory()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[KVStoreClient]:
    """A :class:`KVStoreClient` in :data:`NAMESPACE` on ``server``."""
    with server.client() as kv:
        yield kv


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` of the test's own, on a free loopback port (a module may
    override it, e.g. to bind it on a network namespace's bridge)."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def unused_target() -> str:
    """A loopback ``HOST:PORT`` on which nothing listens."""
    return f"127.0.0.1:{free_port()}"


#: The planes an ``each_plane`` test runs on, and the ids its runs get.
PLANES = {"shm-or-grpc": "auto", "grpc-only": "grpc"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "each_plane: the behaviour depends on the client's data plane (the bytes' path, its "
        "fallbacks or its failure handling): run once on the automatic plane, once on gRPC only",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run ``each_plane`` tests on every plane of :data:`PLANES`, the others on the first.

    Every test gets the parameter, also those that run once: a module-scoped fixture is set up
    again whenever its parameter changes, so one value for all of a module's tests on the
    automatic plane keeps its module servers to one per plane. A module that defines its own
    ``data_plane`` fixture (test_ucx) pins its plane itself and is left alone.
    """
    if "data_plane" not in metafunc.fixturenames or hasattr(metafunc.module, "data_plane"):
        return
    each = metafunc.definition.get_closest_marker("each_plane") is not None
    ids = list(PLANES) if each else ["shm-or-grpc"]
    values = [PLANES[name] for name in ids]
    metafunc.parametrize("data_plane", values, ids=ids, indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def data_plane(request: pytest.FixtureRequest) -> Iterator[str]:
    """``KVSTORE_DATA_PLANE`` for the clients a module's tests build without a ``data_plane``
    argument (their subprocesses too): ``"auto"`` (shared memory, since tests and servers share
    this host, where the server has a dram arena) or ``"grpc"``.

    Module-scoped, and a dependency of ``module_server_factory``, so that each plane gets fresh
    module servers (tests that reuse fixed keys would otherwise find them already stored)."""
    plane = str(request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSTORE_DATA_PLANE", plane)
        yield plane
