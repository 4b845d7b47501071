"""The README's vLLM server command, run as written, against a real ``kvstore serve``.

The command is read from README.md (the fenced block after ``<!-- tested: vllm-server -->``), so
the README and this test cannot drift apart. Only its placeholders are replaced: the model name
by the suite's tiny local model, ``--port 8000`` by a free port and the ``target`` by the test's
store; a few flags that keep the run short on this CPU are appended (a smaller context, no
torch.compile warm-up). Server 1 answers a completion whose prompt is longer than two chunks and
stores its chunks; server 2, a fresh engine with an empty prefix cache on the same store, answers
the same prompt and must report the whole chunks as cached tokens, loaded from kvstore.

Needs vLLM's CPU build; skipped without it unless ``KVSTORE_REQUIRE_VLLM=1``. Runtime: about
two minutes on two cores, mostly the start-up of two API servers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from api_server import ApiServerProcess, server_env, wait_all_healthy
from fleet import build_model
from harness.ports import free_port
from harness.serve import ServerProcess

from kvstore.key_scheme import namespace_from_json

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HERE = Path(__file__).parent
README = HERE.parent.parent / "README.md"
MARKER = "<!-- tested: vllm-server -->"
README_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
README_TARGET = "127.0.0.1:50051"
CHUNK = 256
PROMPT_WORDS = 700  # the tiny tokenizer makes more than two whole chunks of tokens of them
# Test-only additions: keep the engine small and skip a ~45 s torch.compile warm-up.
TEST_FLAGS = " --max-model-len 2048 --enforce-eager"


def readme_server_command() -> str:
    """The shell command in the fenced block that follows the marker in README.md."""
    text = README.read_text()
    match = re.search(re.escape(MARKER) + r"\s*```(?:bash|sh)?\n(.*?)```", text, re.DOTALL)
    assert match, f"README.md has no fenced block after {MARKER}"
    return match.group(1).strip()


def test_readme_block_is_the_api_server_command() -> None:
    command = readme_server_command()
    assert command.startswith("python -m vllm.entrypoints.openai.api_server")
    assert "vllm serve" not in command  # fails on the CPU build (no `vllm` distribution)
    for needed in (README_MODEL, "--port 8000", README_TARGET, "--enable-prompt-tokens-details"):
        assert needed in command


class ApiServer(ApiServerProcess):
    """The README's command in a shell, started and waited for until ``/health`` answers."""

    def __init__(self, name: str, workdir: Path, model: Path, target: str) -> None:
        port = free_port()
        command = (
            readme_server_command()
            .replace(README_MODEL, str(model))
            .replace("--port 8000", f"--port {port}")
            .replace(README_TARGET, target)
        )
        python_dir = str(Path(sys.executable).parent)
        env = server_env(PATH=python_dir + os.pathsep + os.environ.get("PATH", ""))
        super().__init__(
            name, ["bash", "-c", command + TEST_FLAGS], workdir / f"{name}.log", env, port
        )
        wait_all_healthy([self])

    def complete(self, model: Path, prompt: str) -> dict[str, Any]:
        """One greedy completion over HTTP; the response's JSON."""
        body = {"model": str(model), "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        return self.post_completion(body, timeout=120)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model"))


def _cached_tokens(response: dict[str, Any]) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _poll(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s")
        time.sleep(0.5)


def _cli_stats(target: str) -> dict[str, Any]:
    """``kvstore stats --json`` as a user would run it."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvstore.cli import main; sys.exit(main())",
            "stats",
            "--json",
            "--target",
            target,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    stats: dict[str, Any] = json.loads(done.stdout)
    return stats


def test_second_server_reports_tokens_cached_in_kvstore(
    tmp_path: Path, model: Path, store: ServerProcess
) -> None:
    prompt = " ".join(f"t{3 + (i * 37) % 1000}" for i in range(PROMPT_WORDS))

    first = ApiServer("server1", tmp_path, model, store.target)
    try:
        response = first.complete(model, prompt)
        prompt_tokens = int(response["usage"]["prompt_tokens"])
        assert prompt_tokens > 2 * CHUNK, first.tail()
        assert _cached_tokens(response) == 0
        # The worker saves after the request; wait until every whole chunk reached the store.
        _poll(lambda: store.stats()["blocks"] >= prompt_tokens // CHUNK, "chunks stored")
        # The connector's start-up line shows in the server's own output (vLLM configures only
        # its own logger), with the namespace `kvstore router --namespace` takes, as it takes it.
        line = re.search(r"kvstore router --namespace '(\{.*\})'", first.log.read_text())
        assert line is not None, first.tail()
        namespace = namespace_from_json(line.group(1), "--namespace")
        assert namespace.model == str(model) and namespace.tp_rank == 0
    finally:
        first.stop()

    second = ApiServer("server2", tmp_path, model, store.target)
    try:
        response = second.complete(model, prompt)
        # The store hears of reads through its published index a moment later, from the
        # reader's background TOUCH (at most one per 50 ms window): ask while the engine that
        # read is still up, as a user watching `kvstore stats` would (a process stopped at once
        # may take its last window's count with it).
        stats = _poll(
            lambda: (s := _cli_stats(store.target))["counters"].get("hits", 0) > 0 and s,
            "kvstore stats shows hits",
        )
    finally:
        second.stop()
    # Every whole chunk came from kvstore (vLLM computes at least the prompt's last token itself,
    # so a prompt of exactly n chunks loads n - 1 of them).
    assert response["usage"]["prompt_tokens"] == prompt_tokens
    assert _cached_tokens(response) == (prompt_tokens - 1) // CHUNK * CHUNK, second.tail()
    assert stats["blocks"] == prompt_tokens // CHUNK
