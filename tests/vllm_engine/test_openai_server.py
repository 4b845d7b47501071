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
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness.polling import poll_value
from harness.serve import ServerProcess
from harness.vllm_readme_server import (
    CHUNK,
    PROMPT_WORDS,
    README_MODEL,
    README_TARGET,
    ReadmeApiServer,
    readme_server_command,
)
from harness.vllm_readme_server import model as model  # the fixture, shared

from kvstore.key_scheme import namespace_from_json

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_readme_block_is_the_api_server_command() -> None:
    command = readme_server_command()
    assert command.startswith("python -m vllm.entrypoints.openai.api_server")
    assert "vllm serve" not in command  # fails on the CPU build (no `vllm` distribution)
    for needed in (README_MODEL, "--port 8000", README_TARGET, "--enable-prompt-tokens-details"):
        assert needed in command


def _cached_tokens(response: dict[str, Any]) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


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

    first = ReadmeApiServer("server1", tmp_path, model, store.target)
    try:
        response = first.complete(model, prompt)
        prompt_tokens = int(response["usage"]["prompt_tokens"])
        assert prompt_tokens > 2 * CHUNK, first.tail()
        assert _cached_tokens(response) == 0
        # The worker saves after the request; wait until every whole chunk reached the store.
        poll_value(lambda: store.stats()["blocks"] >= prompt_tokens // CHUNK, "chunks stored")
        # The connector's start-up line shows in the server's own output (vLLM configures only
        # its own logger), with the namespace `kvstore router --namespace` takes, as it takes it.
        line = re.search(r"kvstore router --namespace '(\{.*\})'", first.log.read_text())
        assert line is not None, first.tail()
        namespace = namespace_from_json(line.group(1), "--namespace")
        assert namespace.model == str(model) and namespace.tp_rank == 0
    finally:
        first.stop()

    second = ReadmeApiServer("server2", tmp_path, model, store.target)
    try:
        response = second.complete(model, prompt)
        # The store hears of reads through its published index a moment later, from the
        # reader's background TOUCH (at most one per 50 ms window): ask while the engine that
        # read is still up, as a user watching `kvstore stats` would (a process stopped at once
        # may take its last window's count with it).
        stats = poll_value(
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
