"""The README's vLLM server command, run as written: the fenced block after
``<!-- tested: vllm-server -->`` in README.md, read at each start so that the README and the tests
cannot drift apart.

Only its placeholders are replaced: the model name by the suite's tiny local model, ``--port
8000`` by a free port and the ``target`` by the test's store; a few flags that keep the run short
on this CPU are appended (:data:`TEST_FLAGS`). Used by the vLLM suite's server tests
(``tests/vllm_engine/test_openai_server.py`` and the tests of metrics and store restarts beside it).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.ports import free_port
from harness.vllm_api_server import ApiServerProcess, server_env, wait_all_healthy
from harness.vllm_fleet import build_model

__all__ = [
    "CHUNK",
    "PROMPT_WORDS",
    "README_MODEL",
    "README_TARGET",
    "ReadmeApiServer",
    "model",
    "readme_server_command",
]

README = Path(__file__).resolve().parents[2] / "README.md"
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


class ReadmeApiServer(ApiServerProcess):
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
    """The suite's tiny random Llama, built once per test module."""
    return build_model(tmp_path_factory.mktemp("model"))
