"""A real SGLang server on this machine's CPU, as the engine tier and the TTFT benchmark start it.

The command is ``docs/sglang.md``'s (the fenced block after ``<!-- tested: sglang-server -->``),
run as written but for what a CPU test must change: ``python -m sglang.launch_server`` becomes
``python tests/sglang_engine/launch_cpu_server.py`` (the same launcher with the CPU stand-ins
installed in every process, :mod:`harness.sglang_cpu`), the model, port and store address are the
test's, and :data:`CPU_FLAGS` are appended. Starting it in its own process group, waiting for
``/health``, one ``/generate`` and stopping the whole group (SGLang spawns a scheduler and a
detokenizer) are this module's. Test support only.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.stop_process import stop_group

__all__ = [
    "CPU_FLAGS",
    "DOC",
    "DOC_MODEL",
    "DOC_PORT",
    "DOC_TARGET",
    "START_TIMEOUT_S",
    "SGLangServer",
    "documented_command",
    "flag_value",
    "wait_all_healthy",
]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sglang.md"
LAUNCHER = ROOT / "tests" / "sglang_engine" / "launch_cpu_server.py"
DOC_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DOC_PORT = "30000"
DOC_TARGET = "127.0.0.1:50051"
#: Appended on a CPU: SGLang's CPU device; a small KV pool (without it the CPU engine takes 72 %
#: of free RAM for it); no CUDA graphs; the cache report that says where cached tokens came from.
CPU_FLAGS = (
    *("--device", "cpu"),
    *("--max-total-tokens", "8192"),
    "--disable-cuda-graph",
    "--enable-cache-report",
)
#: Two engines starting side by side on two loaded cores take minutes (about 2 each, unloaded).
START_TIMEOUT_S = 900.0


def documented_command(marker: str = "sglang-server") -> str:
    """The shell command in the fenced block after ``<!-- tested: MARKER -->`` in docs/sglang.md."""
    tag = f"<!-- tested: {marker} -->"
    match = re.search(re.escape(tag) + r"\s*```(?:bash|sh)?\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert match, f"docs/sglang.md has no fenced block after {tag}"
    return match.group(1).strip()


def flag_value(words: Sequence[str], name: str) -> str:
    """The value after ``name`` in ``words`` (a test fails where the flag is missing)."""
    assert name in words, f"the documented SGLang command has no {name}"
    return words[list(words).index(name) + 1]


def cpu_command(
    model: Path, port: int, target: str, documented: str | None = None, **replace: str
) -> list[str]:
    """The documented command for this CPU: the launcher with stand-ins, this test's model,
    port and store; ``replace`` gives more of its flags other values
    (``hicache_storage_backend="file"``; ``""`` drops the flag)."""
    words = shlex.split(documented or documented_command())
    assert words[:3] == ["python", "-m", "sglang.launch_server"], words[:3]
    out = [sys.executable, str(LAUNCHER)]
    for word in words[3:]:
        out.append(
            str(model)
            if word == DOC_MODEL
            else str(port)
            if word == DOC_PORT
            else word.replace(DOC_TARGET, target)
        )
    for name, value in replace.items():
        key = "--" + name.replace("_", "-")
        if value == "":
            at = out.index(key)
            del out[at : at + 2]
        else:
            out[out.index(key) + 1] = value
    return [*out, *CPU_FLAGS]


def server_env(**more: str) -> dict[str, str]:
    """The engine's environment: this one without kvstore's settings, offline, ``more``."""
    from harness.serve import without_settings

    return {**without_settings(), "HF_HUB_OFFLINE": "1", "SGLANG_USE_CPU_ENGINE": "1", **more}


class SGLangServer:
    """An SGLang server on 127.0.0.1:``port`` started by ``command``, its output in ``log``."""

    def __init__(
        self, name: str, command: Sequence[str], log: Path, port: int, env: dict[str, str]
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.command = list(command)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def tail(self, lines: int = 40) -> str:
        """The log's last lines (SGLang's one-line dump of its arguments left out)."""
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in text if "server_args=" not in line)[-8000:]

    def healthy(self) -> bool:
        """True once ``/health`` answers 200; raises if the server exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"SGLang server {self.name} exited:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def post(self, path: str, body: dict[str, Any] | None, timeout: float = 300) -> Any:
        """POST ``body`` (JSON) to ``path``; the answer (JSON where it is JSON)."""
        request = urllib.request.Request(
            self.url + path,
            None if body is None else json.dumps(body).encode(),
            {"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{self.name} answered {exc.code}: {exc.read()[:500]!r}") from exc
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """One greedy ``/generate`` of token ids, with the output tokens' log-probabilities."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "return_logprob": True,
        }
        answer: dict[str, Any] = self.post("/generate", body)
        return answer

    def flush_cache(self) -> None:
        """Empty the device and host caches (``/flush_cache``); storage keeps its pages."""
        self.post("/flush_cache", None)

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after 30 s."""
        stop_group(self.proc)


def wait_all_healthy(servers: Sequence[SGLangServer], timeout: float = START_TIMEOUT_S) -> float:
    """Wait until every server answers ``/health`` (their start seconds); stop them all and
    raise otherwise."""
    started = time.monotonic()
    try:
        while not all(server.healthy() for server in servers):
            if time.monotonic() - started > timeout:
                tails = "\n".join(f"--- {s.name}\n{s.tail()}" for s in servers)
                raise RuntimeError(f"SGLang servers did not start within {timeout:.0f} s:\n{tails}")
            time.sleep(1.0)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return time.monotonic() - started
