"""Real processes for the prefill/decode hand-off test: vLLM OpenAI API servers with the kvstore
connector in a given ``kv_role``, and ``kvstore router`` in P/D mode.

The server command is the README's (``python -m vllm.entrypoints.openai.api_server ...
--kv-transfer-config``) with the role filled in and the flags that keep a CPU run short
(``--max-model-len``, ``--enforce-eager``). Servers are started together and waited for
together: each start-up takes about a minute on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from store_process import free_port

__all__ = ["ApiServer", "RouterProcess", "post_json", "start_servers"]

START_TIMEOUT_S = 300


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


class _Process:
    """A command in its own process group (vLLM spawns children), logging to a file."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class ApiServer(_Process):
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
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        transfer = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"target": target, **(extra or {})},
        }
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(transfer),
            "--max-model-len",
            "2048",
            "--enforce-eager",
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        super().__init__(command, workdir / f"{name}.log", env)

    def ready(self) -> bool:
        """True once ``/health`` answers; fails the test if the server died."""
        if self.proc.poll() is not None:
            pytest.fail(f"vLLM server {self.name} exited:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def start_servers(servers: list[ApiServer]) -> None:
    """Wait until every server answers ``/health``; stop them all and fail otherwise."""
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not all(server.ready() for server in servers):
            if time.monotonic() > deadline:
                pytest.fail("vLLM servers did not start:\n" + "\n".join(s.tail() for s in servers))
            time.sleep(1.0)
    except BaseException:
        for server in servers:
            server.stop()
        raise


class RouterProcess(_Process):
    """``kvstore router`` in P/D mode (``--prefill`` / ``--decode``) on a free port."""

    def __init__(self, workdir: Path, prefill: list[str], decode: list[str]) -> None:
        command = [sys.executable, "-m", "kvstore.cli", "router", "--listen", "127.0.0.1:0"]
        for replica in prefill:
            command += ["--prefill", replica]
        for replica in decode:
            command += ["--decode", replica]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
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
