"""vLLM's OpenAI API server as the vLLM tests start it: in its own process group, logging to a file.

The fleet (:mod:`.vllm_fleet`), the P/D hand-off (:mod:`.vllm_pd_servers`) and the README's
server command (:mod:`.vllm_readme_server`) each build their own command line; starting, waiting
for ``/health``, asking for a completion and stopping the whole group (vLLM spawns an engine core
and workers) is this module's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from harness.stop_process import stop_group

__all__ = [
    "START_TIMEOUT_S",
    "ApiServerProcess",
    "GroupProcess",
    "connector_command",
    "server_env",
    "wait_all_healthy",
]

#: Two engines starting side by side on two loaded cores can take minutes.
START_TIMEOUT_S = 600


def connector_command(
    model: Path,
    port: int,
    target: str,
    *,
    role: str = "kv_both",
    extra: dict[str, Any] | None = None,
    max_model_len: int = 2048,
) -> list[str]:
    """The API server with the kvstore connector (``role``, ``extra`` beside ``target`` in
    ``kv_connector_extra_config``), plus the flags that keep a CPU run short."""
    transfer = {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": target, **(extra or {})},
    }
    return [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(model), "--port", str(port)),
        "--enable-prompt-tokens-details",
        *("--max-model-len", str(max_model_len), "--enforce-eager"),
        *("--kv-transfer-config", json.dumps(transfer)),
    ]


def server_env(**more: str) -> dict[str, str]:
    """This process's environment for an API server: offline, a 1 GiB CPU KV cache, ``more``."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **more}


class GroupProcess:
    """A command in its own process group, its output in ``log``."""

    def __init__(self, command: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def tail(self, lines: int = 40) -> str:
        """The log's last lines."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after 30 s."""
        stop_group(self.proc)


class ApiServerProcess(GroupProcess):
    """An API server started by ``command``, which must make it listen on 127.0.0.1:``port``."""

    def __init__(
        self, name: str, command: Sequence[str], log: Path, env: dict[str, str], port: int
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(command, log, env)

    def healthy(self) -> bool:
        """True once ``/health`` answers 200; fails the test if the server exited."""
        if self.proc.poll() is not None:
            pytest.fail(f"vLLM server {self.name} exited:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def post_completion(self, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        """POST ``body`` to ``/v1/completions``; the answer's JSON (an error status fails)."""
        request = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{self.name} answered {exc.code}: {exc.read()[:500]!r}")
        return answer


def wait_all_healthy(servers: Sequence[ApiServerProcess], timeout: float = START_TIMEOUT_S) -> None:
    """Wait until every server answers ``/health``; stop them all and fail the test otherwise."""
    deadline = time.monotonic() + timeout
    try:
        while not all(server.healthy() for server in servers):
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}\n{s.tail()}" for s in servers)
                pytest.fail(f"vLLM servers did not start within {timeout:.0f} s:\n{tails}")
            time.sleep(1.0)
    except BaseException:
        for server in servers:
            server.stop()
        raise
