"""``kvstore router`` as a real subprocess: the one launcher of the tests' routers.

:class:`RouterProcess` starts ``python -m kvstore.cli router`` on a free loopback port (its
settings from flags and ``KVSTORE_ROUTER_*`` variables, every other ``KVSTORE_*`` variable of
the test's environment left out), waits for its ready line, and talks HTTP to it: JSON calls
(:meth:`call`), raw requests whose bytes the test chooses (:meth:`send`), metrics, its log and
its memory (``/proc/PID/status``). ``policy`` and ``args`` (any other flags: ``--prefill`` /
``--decode`` for P/D mode, ``--index-timeout-s``, ...) cover what the real-engine suites need.
:func:`launch_router` is the start alone, which the vLLM fleet's router (:mod:`.vllm_fleet`)
shares.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from harness.serve import without_settings

__all__ = ["RouterProcess", "http_exchange", "launch_router"]


def http_exchange(
    host: str, port: int, method: str, path: str, body: Any = None, timeout: float = 30.0
) -> tuple[int, bytes]:
    """One plain HTTP request with ``body`` as JSON; the status and the response body."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload else {}
        connection.request(method, path, payload, headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def launch_router(
    flags: Sequence[str], env: Mapping[str, str], log_path: Path
) -> tuple[subprocess.Popen[bytes], BinaryIO, str, int]:
    """Start ``python -m kvstore.cli router --listen 127.0.0.1:0 FLAGS`` with ``env``, its log in
    ``log_path`` (opened for reading back too), and wait for its ready line: the process, the
    open log, and the host and port it listens on. Raises :class:`RuntimeError`, with the log,
    when the router exits before it is ready (outside pytest too: the benchmarks use it)."""
    command = [sys.executable, "-m", "kvstore.cli", "router", "--listen", "127.0.0.1:0", *flags]
    log = log_path.open("w+b")
    proc = subprocess.Popen(command, env=dict(env), stdout=subprocess.PIPE, stderr=log)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    match = re.match(r"kvstore router on http://(\S+):(\d+)", line)
    if not match:
        proc.kill()
        proc.wait()
        log.seek(0)
        logged = log.read().decode(errors="replace")
        log.close()
        raise RuntimeError(f"router did not start: {line!r}\n{logged}")
    return proc, log, match.group(1), int(match.group(2))


class RouterProcess:
    """``kvstore router`` in a subprocess in front of ``replicas`` (``URL=NODE_ID``)."""

    def __init__(
        self,
        tmp: Path,
        replicas: list[str],
        *,
        namespace: str = "",
        chunk_size: int | None = None,
        index_url: str = "",
        env: Mapping[str, str] | None = None,
        log_level: str = "INFO",
        policy: str = "",
        args: Sequence[str] = (),
    ) -> None:
        flags = ["--log-level", log_level]
        for replica in replicas:
            flags += ["--replica", replica]
        if namespace:  # deprecated: the nodes publish their key scheme in the index
            flags += ["--namespace", namespace]
        if chunk_size is not None:
            flags += ["--chunk-size", str(chunk_size)]
        if index_url:
            flags += ["--index-url", index_url]
        if policy:
            flags += ["--policy", policy]
        self.log_path = tmp / "router.log"
        self.proc, self.log, self.host, self.port = launch_router(
            [*flags, *args], without_settings(env), self.log_path
        )

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the router."""
        return f"http://{self.host}:{self.port}"

    def stderr(self) -> str:
        """Everything the router logged so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """One request with ``body`` as JSON; the status and the response body."""
        return http_exchange(self.host, self.port, method, path, body)

    def complete(self, prompt: Any, **extra: Any) -> dict[str, Any]:
        """A ``/v1/completions`` of ``prompt`` that must answer 200; its JSON answer."""
        status, body = self.call("POST", "/v1/completions", {"prompt": prompt, **extra})
        assert status == 200, body
        answer: dict[str, Any] = json.loads(body)
        return answer

    def send(self, head: str, body: bytes = b"", timeout: float = 30.0) -> tuple[int | None, bytes]:
        """Send ``head`` (request line and headers, without the blank line) and ``body`` as they
        are; the status (``None``: the router closed without answering) and the response body.
        """
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(head.encode("latin-1") + b"\r\n\r\n")
            if body:
                sock.sendall(body)
            chunks = []
            while data := sock.recv(1 << 16):
                chunks.append(data)
        response = b"".join(chunks)
        if not response:
            return None, b""
        status_line, _, rest = response.partition(b"\r\n")
        return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]

    def metric(self, name: str, labels: str) -> float:
        """The value of one series on ``/metrics`` (0 when absent)."""
        _, text = self.call("GET", "/metrics")
        series = name + "{" + labels + "}" if labels else name
        pattern = "^" + re.escape(series) + r" (\S+)$"
        found = re.search(pattern, text.decode(), re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def memory(self, field: str = "VmRSS") -> int:
        """A ``/proc/PID/status`` memory figure of the router, in bytes (VmRSS, VmHWM...)."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(rf"^{field}:\s+(\d+) kB$", text, re.MULTILINE)
        assert found, f"no {field} in /proc/{self.proc.pid}/status"
        return int(found.group(1)) * 1024

    def reset_peak_memory(self) -> None:
        """Start VmHWM again from the current resident size (``clear_refs`` 5)."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def health_seconds(self, timeout: float = 30.0) -> float:
        """How long ``/health`` took to answer 200."""
        started = time.monotonic()
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            assert response.status == 200, response.status
        finally:
            connection.close()
        return time.monotonic() - started

    def stop(self) -> None:
        """Kill the router."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()
