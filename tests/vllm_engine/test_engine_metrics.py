"""The connector's figures in vLLM's own Prometheus ``/metrics``, from real API servers.

Server 1 (the README's command, as :mod:`test_openai_server` runs it) answers a prompt of more
than two chunks and stores its whole chunks in a real ``kvstore serve``; a short second prompt
makes it run one more engine step, which carries the finished puts' figures. Server 2, a fresh
engine on the same store, answers the long prompt from kvstore. Each server's ``/metrics`` must
show, under ``vllm:kvstore_*``, exactly the tokens of the whole chunks it looked up, found,
loaded and saved, no failed load, and one latency observation per lookup and per load.

Needs vLLM's CPU build; skipped without it unless ``KVSTORE_REQUIRE_VLLM=1``. Runtime: about
two minutes on two cores, mostly the start-up of two API servers.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from harness.polling import poll_value
from harness.serve import ServerProcess
from harness.vllm_readme_server import CHUNK, PROMPT_WORDS, ReadmeApiServer
from harness.vllm_readme_server import model as model  # the fixture, shared

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_SAMPLE = re.compile(r"^(vllm:kvstore_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$")


def kvstore_metrics(server: ReadmeApiServer) -> dict[str, float]:
    """``vllm:kvstore_*`` samples of the server's ``/metrics``, by name and ``reason`` label."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            reason = re.search(r'reason="([^"]+)"', labels or "")
            key = f"{name}[{reason.group(1)}]" if reason else name
            samples[key] = samples.get(key, 0.0) + float(value)
    return samples


def showing(server: ReadmeApiServer, name: str) -> dict[str, float] | None:
    """The server's kvstore samples once ``name`` is above 0 in them (``None`` before)."""
    samples = kvstore_metrics(server)
    return samples if samples.get(name) else None


def failed(samples: dict[str, float], kind: str) -> dict[str, float]:
    """The nonzero ``vllm:kvstore_{kind}_failed_tokens_total`` samples by reason."""
    prefix = f"vllm:kvstore_{kind}_failed_tokens_total["
    return {k: v for k, v in samples.items() if k.startswith(prefix) and v}


def test_each_engine_reports_the_prompt_tokens_kvstore_saved_it(
    tmp_path: Path,
    model: Path,
    store: ServerProcess,
) -> None:
    prompt = " ".join(f"t{3 + (i * 37) % 1000}" for i in range(PROMPT_WORDS))

    first = ReadmeApiServer("server1", tmp_path, model, store.target)
    try:
        prompt_tokens = int(first.complete(model, prompt)["usage"]["prompt_tokens"])
        whole = prompt_tokens // CHUNK * CHUNK  # stored: every whole chunk
        loadable = (prompt_tokens - 1) // CHUNK * CHUNK  # the last token is always computed
        assert loadable >= 2 * CHUNK, first.tail()
        poll_value(lambda: store.stats()["blocks"] >= prompt_tokens // CHUNK, "chunks stored")
        first.complete(model, "a short prompt")  # one more step reports the finished puts
        one = poll_value(
            lambda: showing(first, "vllm:kvstore_saved_tokens_total"),
            "server 1's /metrics shows saved tokens",
        )
    finally:
        first.stop()
    assert one["vllm:kvstore_saved_tokens_total"] == whole, one
    assert one["vllm:kvstore_lookup_tokens_total"] == loadable, one
    assert one["vllm:kvstore_hit_tokens_total"] == 0
    assert one["vllm:kvstore_loaded_tokens_total"] == 0
    assert failed(one, "save") == {}
    assert one["vllm:kvstore_lookup_seconds_count"] == 1  # the short prompt has no whole chunk

    second = ReadmeApiServer("server2", tmp_path, model, store.target)
    try:
        second.complete(model, prompt)
        two = poll_value(
            lambda: showing(second, "vllm:kvstore_loaded_tokens_total"),
            "server 2's /metrics shows loaded tokens",
        )
    finally:
        second.stop()
    assert two["vllm:kvstore_loaded_tokens_total"] == loadable, two
    assert two["vllm:kvstore_lookup_tokens_total"] == loadable
    assert two["vllm:kvstore_hit_tokens_total"] == loadable
    # A dram hit on a CPU engine loads far faster than it computes: the load plan declines none.
    assert two.get("vllm:kvstore_declined_tokens_total", 0) == 0
    assert failed(two, "load") == {}
    assert two["vllm:kvstore_load_seconds_count"] == 1
    assert two["vllm:kvstore_lookup_seconds_count"] == 1
    # Every reason is exported from the start, at 0, so an alert on one has a series to watch.
    assert "vllm:kvstore_load_failed_tokens_total[missing]" in two
