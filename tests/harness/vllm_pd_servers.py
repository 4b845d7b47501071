"""Real processes for the prefill/decode hand-off test: vLLM OpenAI API servers with the kvstore
connector in a given ``kv_role``, and ``kvstore router`` in P/D mode.

The server command is the README's (``python -m vllm.entrypoints.openai.api_server ...
--kv-transfer-config``) with the role filled in and the flags that keep a CPU run short
(``--max-model-len``, ``--enforce-eager``). Servers are started together and waited for
together: each start-up takes about a minute on two cores.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.ports import free_port
from harness.serve import without_settings
from harness.vllm_api_server import (
    ApiServerProcess,
    GroupProcess,
    connector_command,
    server_env,
    wait_all_healthy,
)

__all__ = ["ApiServer", "RouterProcess", "post_json", "start_servers"]


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> bytes:
    """POST ``body`` as JSON; the response's raw bytes (an error status fails the test)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data: bytes = response.read()
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{url} answered {exc.code}: {exc.read()[:500]!r}")
    return data


class ApiServer(ApiServerProcess):
    """``python -m vllm.entrypoints.openai.api_server`` with the connector in ``role``."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        model: Path,
        target: str,
        role: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        port = free_port()
        command = connector_command(model, port, target, role=role, extra=extra)
        env = server_env()
        super().__init__(name, command, workdir / f"{name}.log", env, port)


#: Start the servers side by side, then wait for them all (each start-up takes about a minute).
start_servers = wait_all_healthy


class RouterProcess(GroupProcess):
    """``kvstore router`` in P/D mode (``--prefill`` / ``--decode``) on a free port."""

    def __init__(self, workdir: Path, prefill: list[str], decode: list[str]) -> None:
        command = [sys.executable, "-m", "kvstore.cli", "router", "--listen", "127.0.0.1:0"]
        for replica in prefill:
            command += ["--prefill", replica]
        for replica in decode:
            command += ["--decode", replica]
        env = without_settings()
        super().__init__(command, workdir / "router.log", env)
        deadline = time.monotonic() + 60
        self.url = ""
        while not self.url:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("kvstore router on "):
                    self.url = line.removeprefix("kvstore router on ").strip()
            if not self.url:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"kvstore router did not start:\n{self.tail()}")
                time.sleep(0.2)

    def metrics(self) -> str:
        """The router's ``/metrics`` text."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text: str = response.read().decode()
        return text
