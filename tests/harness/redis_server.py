"""A real ``redis-server`` subprocess for tests: start, kill, restart on the same port, pause.

Not a conftest: test modules import :class:`RedisServer` and wrap it in their own fixture.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis

from harness.ports import free_port
from harness.stop_process import stop_process

__all__ = ["RedisServer", "redis_server_binary"]


def redis_server_binary() -> str:
    """Path of ``redis-server``; a missing one is an error (the test command installs it), so the
    Redis tests fail loudly instead of quietly skipping."""
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed: the Redis tests need a real one "
            "(scripts/test.sh installs it; on Debian: apt-get install redis-server)"
        )
    return binary


class RedisServer:
    """One non-persistent redis-server on ``127.0.0.1:port`` with its files in ``directory``.

    ``username``/``password`` turn the default user off and admit only that ACL user; ``tls``
    (certificate, key, CA: PEM paths) serves TLS only (clients need no certificate of their own).
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        *,
        username: str = "",
        password: str = "",
        tls: tuple[Path, Path, Path] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.binary = redis_server_binary()
        self.host = host  # the address it binds and its URL names (a bridge address for netns)
        self.username = username
        self.password = password
        self.tls = tls
        self.directory = directory
        self.port = port or free_port()
        self.log_path = directory / f"redis-{self.port}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS, and ``USER:PASS@`` with a user;
        the CA rides as the ``ssl_ca_certs`` query argument, which redis-py passes through)."""
        credentials = f"{self.username}:{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{credentials}{self.host}:{self.port}/0"
        return f"rediss://{credentials}{self.host}:{self.port}/0?ssl_ca_certs={self.tls[2]}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout)
        return self

    def _command(self) -> list[str]:
        # No RDB snapshots and no AOF: a killed server comes back empty, like a real crash
        # of a cache that nobody persists.
        options = {"port": str(self.port), "bind": self.host, "save": "", "appendonly": "no"}
        if self.host != "127.0.0.1" and not self.password:
            # Protected mode refuses every non-loopback client of a user without a password:
            # the other "hosts" of a network-namespace test are exactly that.
            options["protected-mode"] = "no"
        if self.tls is not None:
            cert, key, ca = self.tls
            options.update(
                {
                    "port": "0",
                    "tls-port": str(self.port),
                    "tls-cert-file": str(cert),
                    "tls-key-file": str(key),
                    "tls-ca-cert-file": str(ca),
                    "tls-auth-clients": "no",
                }
            )
        flags = [part for name, value in options.items() for part in (f"--{name}", value)]
        if self.password:
            user = [self.username or "default", "on", f">{self.password}", "~*", "&*", "+@all"]
            flags += ["--user", "default", "off", "--user", *user]
        return [self.binary, *flags, "--dir", str(self.directory)]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client(timeout=0.5)
        try:
            while True:
                assert self._process is not None
                if self._process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self._process.returncode}: "
                        f"{self.log_path.read_text(errors='replace')[-2000:]}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.02)
        finally:
            client.close()

    def client(self, timeout: float = 2.0) -> redis.Redis:
        """A synchronous client for poking at raw keys (with the server's user and TLS)."""
        return redis.Redis.from_url(
            self.url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def wait_for_blocks(
        self, keys: Sequence[bytes], prefix: str = "kvstore:v1:", timeout: float = 30.0
    ) -> None:
        """Wait until every key's payload is in Redis (under ``prefix``, ``redis.key_prefix``'s
        default): write-through runs in the background, so a loaded machine may answer the put
        before the copy lands."""
        client = self.client()
        try:
            deadline = time.monotonic() + timeout
            while client.exists(*(prefix + key.hex() for key in keys)) < len(keys):
                assert time.monotonic() < deadline, "write-through never reached Redis"
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server: a crash, connections reset, data gone."""
        self.resume()
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def restart(self, timeout: float = 10.0) -> None:
        """Kill it if it runs, then start a fresh (empty) server on the same port."""
        self.kill()
        self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP the server: a stall, connections stay open but nothing answers."""
        if self._process is not None and not self._paused:
            self._process.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._process is not None and self._paused:
            self._process.send_signal(signal.SIGCONT)
            self._paused = False

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after a few seconds)."""
        self.resume()
        if self._process is None:
            return
        stop_process(self._process, grace_s=5)
        self._process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
