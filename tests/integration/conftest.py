"""Fixtures of the integration tests: a real ``kvstore serve`` subprocess on a free loopback port.

Nothing here is mocked. :class:`ServerProcess` runs ``python -m kvstore.cli serve`` with an nvme
directory of its own, waits for the ``kvstore serving on ADDR`` line and stops the process with a
signal, asserting that a graceful stop exits 0. Fixtures:

* ``server_factory`` / ``module_server_factory``: start servers with given flags and environment;
  every server they started is killed at the end of the test (or module) if still running.
* ``server``: a default server for one test; ``client``: a :class:`KVStoreClient` on it.
* ``data_plane`` (autouse): the plane clients choose through ``KVSTORE_DATA_PLANE``. A test
  marked ``each_plane`` runs twice, on the automatic plane and on gRPC only; any other runs
  once, on the automatic plane (what users get).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from harness.ports import free_port
from harness.redis_server import RedisServer
from netns_hosts import Host

from kvstore import KVStoreClient, Namespace

READY_LINE = "kvstore serving on "
#: What ``kvstore serve`` prints (before the ready line) when its /metrics endpoint is up.
METRICS_LINE = "kvstore metrics on "
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0

# A server killed at the end of a test (SIGKILL) cannot remove its shared-memory socket
# directory. Servers make it in this directory (their TMPDIR), which the session removes at its
# end, instead of leaving kvstore-* directories in the machine's /tmp. Short, so socket paths stay
# far below the 108-byte limit.
_SERVER_TMPDIR = ""


@pytest.fixture(scope="session", autouse=True)
def _server_tmpdir() -> Iterator[None]:
    global _SERVER_TMPDIR
    _SERVER_TMPDIR = tempfile.mkdtemp(prefix="kvt-")
    yield
    shutil.rmtree(_SERVER_TMPDIR, ignore_errors=True)


#: The namespace the ``client`` fixture uses.
NAMESPACE = Namespace(model="integration-test", num_layers=2, num_kv_heads=2, head_size=64)


class ServerProcess:
    """One ``kvstore serve`` subprocess; :meth:`start` again after a stop reuses its nvme dir."""

    def __init__(
        self,
        workdir: Path,
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        nvme_path: Path | None = None,
        host: Host | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        #: The network namespace it runs in (tests/netns_hosts.py); None: this host, loopback.
        self.host = host
        self.workdir = workdir
        self.nvme_path = nvme_path if nvme_path is not None else workdir / "nvme"
        self.flags = list(flags)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""
        #: ``http://HOST:PORT/metrics`` of the current run ("" where metrics are off).
        self.metrics_url = ""
        self.returncode: int | None = None
        self._starts = 0

    @property
    def stdout_path(self) -> Path:
        return self.workdir / f"serve-{self._starts}.out"

    @property
    def stderr_path(self) -> Path:
        return self.workdir / f"serve-{self._starts}.err"

    def stderr(self) -> str:
        """What the current (or last) run wrote to stderr: the server's log."""
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text(errors="replace")
        return ""

    def start(self) -> ServerProcess:
        """Start on a fresh free port and wait for the ready line; fail with the server's log."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._starts += 1
        address = self.host.address if self.host is not None else "127.0.0.1"
        listen = f"{address}:{free_port()}"
        command = [
            sys.executable,
            "-m",
            "kvstore.cli",
            "serve",
            "--listen",
            listen,
            "--nvme-path",
            str(self.nvme_path),
            # Port 0: many servers run at once, and the default 9464 would be fought over.
            "--metrics-listen",
            "127.0.0.1:0",
            *self.flags,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": _SERVER_TMPDIR, **self.env}
        if "XDG_RUNTIME_DIR" not in self.env:
            env.pop("XDG_RUNTIME_DIR", None)  # else the socket directory would go there
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            # `ip netns exec` execs the server itself: the pid and its signals are the server's.
            argv = self.host.command(command) if self.host is not None else command
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        self.returncode = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = self.stdout_path.read_text(errors="replace")
            if READY_LINE in text and text.endswith("\n"):
                line = next(line for line in text.splitlines() if READY_LINE in line)
                self.target = line.split(READY_LINE, 1)[1].strip()
                self.metrics_url = next(
                    (
                        line.split(METRICS_LINE, 1)[1].strip()
                        for line in text.splitlines()
                        if METRICS_LINE in line
                    ),
                    "",
                )
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = (
                    f"exited with {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"not ready after {START_TIMEOUT_S:.0f}s"
                )
                self.kill()
                raise RuntimeError(
                    f"kvstore serve {' '.join(command[4:])} {state}\n"
                    f"--- stdout ---\n{text}\n--- stderr ---\n{self.stderr()}"
                )
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait; SIGTERM and SIGINT must shut down gracefully with exit code 0."""
        assert self.proc is not None, "never started"
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.returncode = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"kvstore serve ignored {signal.Signals(sig).name} for {STOP_TIMEOUT_S:.0f}s\n"
                f"{self.stderr()}"
            ) from None
        if sig in (signal.SIGTERM, signal.SIGINT):
            assert self.returncode == 0, (
                f"kvstore serve exited {self.returncode} on {signal.Signals(sig).name}\n"
                f"{self.stderr()}"
            )
        return self.returncode

    def restart(self) -> ServerProcess:
        """SIGTERM (asserting a clean exit), then start again on the same nvme directory."""
        self.stop()
        return self.start()

    def kill(self) -> None:
        """SIGKILL, no questions asked (also the cleanup of every fixture)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.returncode = self.proc.wait()

    def client(
        self, namespace: Namespace | bytes | None = NAMESPACE, **kwargs: Any
    ) -> KVStoreClient:
        """A blocking client on this server."""
        return KVStoreClient(self.target, namespace=namespace, **kwargs)


ServerFactory = Callable[..., ServerProcess]


@contextlib.contextmanager
def _factory(root: Path) -> Iterator[ServerFactory]:
    started: list[ServerProcess] = []

    def start(
        *flags: str,
        env: Mapping[str, str] | None = None,
        dram_capacity: str = "64MiB",
        nvme_capacity: str = "64MiB",
        nvme_path: Path | None = None,
        host: Host | None = None,
    ) -> ServerProcess:
        process = ServerProcess(
            root / f"server-{len(started)}",
            ["--dram-capacity", dram_capacity, "--nvme-capacity", nvme_capacity, *flags],
            env,
            nvme_path=nvme_path,
            host=host,
        )
        started.append(process)
        return process.start()

    try:
        yield start
    finally:
        for process in started:
            process.kill()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """``server_factory(*flags, env=..., dram_capacity=..., nvme_capacity=...)`` for one test."""
    with _factory(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_server_factory(
    tmp_path_factory: pytest.TempPathFactory, data_plane: str
) -> Iterator[ServerFactory]:
    """Like ``server_factory``, for servers shared by the tests of one module."""
    with _factory(tmp_path_factory.mktemp("servers")) as start:
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
