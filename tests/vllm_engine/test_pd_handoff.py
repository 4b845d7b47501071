"""Prefill/decode hand-off end to end: two real vLLM CPU API servers, one ``kvstore serve`` and
``kvstore router`` in P/D mode.

The producer (``kv_role`` ``kv_producer``) computes each prompt with ``max_tokens=1`` and saves its
whole chunks; the consumer (``kv_consumer``), a fresh engine with an empty prefix cache, must
report every whole chunk of the prompt as cached (loaded from kvstore: it has nothing of its own,
and vLLM computes at least the prompt's last token itself) and produce, token for token, the greedy
output of a single engine that computes the whole prompt.

The reference is the producer asked directly with a ``cache_salt``: the salt keeps vLLM's own
prefix cache from reusing the prefill it just did (its cached-token count is checked to be 0), and
a producer never loads from kvstore, so it computes every prompt token itself: a plain single
engine, same model, same flags. Asking it after the hand-off also shows that the producer's saves
(salted keys, under other names) do not change what it computes.

The prompts are token ids (the tiny model's tokenizer has no meaningful text), 4 whole chunks and
a tail. One request goes non-streamed and one streamed (the stream passes through the router).
Needs vLLM's CPU build; about three minutes on two cores, mostly two server start-ups.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.serve import ServerProcess
from harness.vllm_fleet import build_model
from harness.vllm_pd_servers import ApiServer, RouterProcess, post_json, start_servers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256  # the connector's default chunk_size
PROMPT_LEN = 4 * CHUNK + 45
OUTPUT_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, model: Path, store: ServerProcess
) -> Iterator[tuple[ApiServer, ApiServer, RouterProcess]]:
    workdir = tmp_path_factory.mktemp("pd")
    # The producer's puts are asynchronous and its answer can come back first. The defaults (a
    # 5 s put deadline, a 2 s hand-off wait) bound latency on a healthy machine; on a loaded
    # runner a put was seen to miss its 5 s deadline (the save is then dropped, as it should be)
    # and a fresh producer's first puts to land after 2 s. This test is about what the decode
    # engine loads, not how fast: generous bounds keep it about that.
    producer = ApiServer(
        "producer", workdir, model, store.target, "kv_producer", {"timeout_s": 30.0}
    )
    consumer = ApiServer(
        "consumer", workdir, model, store.target, "kv_consumer", {"handoff_wait_s": 60.0}
    )
    start_servers([producer, consumer])
    router = None
    try:
        router = RouterProcess(workdir, [f"{producer.url}=node-a"], [f"{consumer.url}=node-a"])
        yield producer, consumer, router
    finally:
        if router is not None:
            router.stop()
        producer.stop()
        consumer.stop()


def _prompt(seed: int) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 1000 for i in range(PROMPT_LEN)]


def _request(model: Path, prompt: list[int], **more: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **more,
    }


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _reference(producer: ApiServer, model: Path, prompt: list[int]) -> list[int]:
    """The producer's own greedy output, computed from scratch (see the module's docstring)."""
    answer = json.loads(
        post_json(producer.url + "/v1/completions", _request(model, prompt, cache_salt="ref"))
    )
    assert _cached(answer["usage"]) == 0, "the reference reused a cached prefix"
    tokens: list[int] = answer["choices"][0]["token_ids"]
    assert len(tokens) == OUTPUT_TOKENS
    return tokens


def _logs(producer: ApiServer, consumer: ApiServer, store: ServerProcess) -> str:
    """The last lines of every process's log, for a failure message."""
    store_tail = "\n".join(store.stderr().splitlines()[-20:])
    return (
        f"--- producer\n{producer.tail()}\n--- consumer\n{consumer.tail()}\n--- store\n{store_tail}"
    )


def _metric(text: str, series: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series)
    ]
    return sum(values)


def test_decode_engine_loads_the_whole_prompt_and_matches_a_single_engine(
    fleet: tuple[ApiServer, ApiServer, RouterProcess], model: Path, store: ServerProcess
) -> None:
    producer, consumer, router = fleet
    prompt = _prompt(1)
    answer = json.loads(post_json(router.url + "/v1/completions", _request(model, prompt)))
    usage = answer["usage"]
    assert usage["prompt_tokens"] == PROMPT_LEN
    # Every whole chunk came from kvstore: the consumer never saw this prompt before.
    assert _cached(usage) == 4 * CHUNK, _logs(producer, consumer, store)
    tokens = answer["choices"][0]["token_ids"]
    assert tokens == _reference(producer, model, prompt)
    metrics = router.metrics()
    assert _metric(metrics, "kvstore_router_pd_prefills_total") == 1
    assert _metric(metrics, "kvstore_router_pd_prefill_failures_total") == 0
    assert store.stats()["blocks"] >= 4


def test_a_streamed_decode_passes_through_and_matches_too(
    fleet: tuple[ApiServer, ApiServer, RouterProcess], model: Path
) -> None:
    producer, _, router = fleet
    prompt = _prompt(2)
    body = _request(model, prompt, stream=True, stream_options={"include_usage": True})
    raw = post_json(router.url + "/v1/completions", body).decode()
    events = [json.loads(e) for e in re.findall(r"^data: (\{.*\})$", raw, re.MULTILINE)]
    assert raw.rstrip().endswith("data: [DONE]")
    tokens = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert _cached(usage) == 4 * CHUNK
    assert tokens == _reference(producer, model, prompt)
