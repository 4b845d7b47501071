"""The engine tier: real SGLang engines on this CPU, with HiCache and kvstore as its storage.

Two SGLang server processes run ``docs/sglang.md``'s server command
(:mod:`harness.sglang_server`: the launcher with the CPU stand-ins, a tiny random-weight Llama
built here, a free port, this test's ``kvstore serve`` with ``keys.chunk_size`` equal to the
command's ``--page-size``). The writer
answers a prompt of several pages with nothing cached (``cached_tokens`` 0: every token computed,
no byte from the backend used, so its answer is a cold engine's) and HiCache writes the prompt's
pages through to kvstore. The reader, another process with empty device and host caches, answers
the same prompt: its cache report must show the whole pages as ``storage`` tokens from the kvstore
backend, and its output tokens and their log-probabilities must be the writer's. The tiny model's
attention is scaled up (``tiny_model.py``) so that wrong KV bytes change the log-probabilities.

Both engines start side by side (about 2 minutes each here, the test's main cost); the reader's
request goes out only after the store holds every page.
"""

from __future__ import annotations

import random
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.ports import free_port
from harness.serve import ServerProcess
from harness.sglang_server import (
    SGLangServer,
    cpu_command,
    documented_command,
    flag_value,
    server_env,
    wait_all_healthy,
)

pytestmark = [pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 400  # over SGLang's storage prefetch threshold (256 tokens): shorter ones never hit
LOGPROB_TOLERANCE = 1e-3  # another process, a shorter prefill: sums may round differently


def build_model(path: Path) -> Path:
    """The vLLM suite's tiny random Llama (:mod:`harness.tiny_model`), built in a child
    process that installs the CPU stand-ins first (transformers imports torchvision)."""
    import subprocess

    code = (
        "import sys; sys.path[:0] = [sys.argv[1]];"
        "from harness import sglang_cpu; sglang_cpu.install();"
        "from harness.tiny_model import build_tiny_llama; build_tiny_llama(sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "tests"), str(path)],
        check=True,
        timeout=600,
        env=server_env(),
    )
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def page_size() -> int:
    return int(flag_value(shlex.split(documented_command()), "--page-size"))


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A store whose chunk is the documented command's page."""
    server = ServerProcess(
        tmp_path_factory.mktemp("store"),
        settings={"dram.capacity": "256MiB", "keys.chunk_size": page_size()},
        name="store",
    )
    with server:
        yield server


def prompt(seed: int) -> list[int]:
    """``PROMPT_TOKENS`` distinct ids of the tiny vocabulary (3 ... 1023), in a seeded order."""
    return random.Random(seed).sample(range(3, 1024), PROMPT_TOKENS)


def poll(check: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s")
        time.sleep(0.5)


def logprobs(answer: dict[str, Any]) -> list[float]:
    return [float(entry[0]) for entry in answer["meta_info"]["output_token_logprobs"]]


def output_ids(answer: dict[str, Any]) -> list[int]:
    return [int(entry[1]) for entry in answer["meta_info"]["output_token_logprobs"]]


def test_a_second_engine_gets_the_prompt_from_kvstore_with_a_cold_engines_output(
    tmp_path: Path, model: Path, engine_store: ServerProcess
) -> None:
    page = page_size()
    servers = []
    for name in ("writer", "reader"):
        port = free_port()
        command = cpu_command(model, port, engine_store.target)
        servers.append(SGLangServer(name, command, tmp_path / f"{name}.log", port, server_env()))
    writer, reader = servers
    try:
        wait_all_healthy(servers)
        ids = prompt(seed=37)
        cold = writer.generate(ids)
        meta = cold["meta_info"]
        assert meta["prompt_tokens"] == PROMPT_TOKENS, writer.tail()
        # Nothing cached: the writer computed every token, as an engine without a backend does.
        assert meta["cached_tokens"] == 0, meta
        whole_pages = (PROMPT_TOKENS - 1) // page  # SGLang never matches a prompt's last token
        poll(
            lambda: engine_store.stats()["blocks"] >= whole_pages,
            f"the writer's {whole_pages} pages stored in kvstore",
        )

        warm = reader.generate(ids)
        details = warm["meta_info"].get("cached_tokens_details") or {}
        assert details.get("storage") == whole_pages * page, (warm["meta_info"], reader.tail())
        assert details.get("device", 0) == 0 and details.get("host", 0) == 0, details
        assert "kvstore" in str(details.get("storage_backend", "")).lower(), details
        assert output_ids(warm) == output_ids(cold)
        assert logprobs(warm) == pytest.approx(logprobs(cold), abs=LOGPROB_TOLERANCE)
    finally:
        for server in servers:
            server.stop()
