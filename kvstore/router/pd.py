"""Prefill/decode hand-off: the router's P/D mode (``router.prefill`` and ``router.decode``).

Each completion first goes to a *prefill* replica (a vLLM engine whose connector has ``kv_role``
``kv_producer``) as the same prompt or messages with ``max_tokens=1``, not streamed. That engine
computes the prompt and saves its whole chunks to kvstore; its answer's ``kv_transfer_params``
say how many leading chunks it stored or is still storing. The original request then goes, with
those ``kv_transfer_params`` added, to a *decode* replica (``kv_role`` ``kv_consumer``) chosen
like any routed request (:meth:`kvstore.router.service.Router.decide`), and its response,
streamed or not, passes through untouched.

The producer's puts are asynchronous: its response may come back before every chunk is in the
store. The decode engine's connector therefore waits, per request and without holding its
scheduler, until the store holds the count it was given or its ``handoff_wait_s`` has passed (see
:mod:`kvstore.integrations.vllm.scheduler`). The router does not wait itself: only the engine
asks the store the exact keys it will load.

A prefill that fails (no prefill replica reachable, an error status, no answer within
``router.prefill_timeout_s``, an answer that is not JSON) never fails the request: the decode
replica gets the original request and computes whatever the store lacks.
``kvstore_router_pd_prefill_failures_total`` counts such requests by reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstore.router.body import ParsedBody
from kvstore.router.proxy import Request, UpstreamError, send_upstream
from kvstore.router.scoring import Provisional, Replica, Scorer

__all__ = ["PREFILL_FAILURES", "PrefillStage", "decode_body", "prefill_body"]

logger = logging.getLogger(__name__)

#: Reasons a prefill is given up (the label of ``kvstore_router_pd_prefill_failures_total``).
PREFILL_FAILURES = ("unreachable", "timeout", "status", "bad_response")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request of ``body``: same prompt or messages, one token, not streamed."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # chat: the newer name wins over max_tokens in vLLM
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    for name in ("stream_options", "min_tokens", "best_of"):
        out.pop(name, None)
    return out


def decode_body(body: dict[str, Any], transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The original request, carrying the prefill's ``kv_transfer_params`` to the decode engine."""
    out = dict(body)
    theirs = out.get("kv_transfer_params")
    out["kv_transfer_params"] = {**(theirs if isinstance(theirs, dict) else {}), **transfer_params}
    return out


class PrefillFailed(Exception):
    """A prefill gave no usable answer; ``reason`` is one of :data:`PREFILL_FAILURES`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PrefillStage:
    """Sends each request's prefill to the least-loaded prefill replica and counts the results."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        registry: CollectorRegistry,
        *,
        timeout_s: float = 60.0,
        request_cost_tokens: int = 256,
    ) -> None:
        # Prefill replicas are chosen by load: a producer never loads from kvstore, so only
        # what the router itself sent there counts (chunk size and hit weight do not matter).
        self.scorer = Scorer(replicas, 1, 1.0, request_cost_tokens, Provisional(1.0))
        self.timeout_s = timeout_s
        self.prefills = Counter(
            "kvstore_router_pd_prefills",
            "Prefills answered, by prefill replica",
            ["replica"],
            registry=registry,
        )
        self.failures = Counter(
            "kvstore_router_pd_prefill_failures",
            "Requests whose prefill failed, so that the decode replica computed the prompt, by "
            "reason (unreachable, timeout, status, bad_response)",
            ["reason"],
            registry=registry,
        )
        for reason in PREFILL_FAILURES:
            self.failures.labels(reason)
        self.seconds = Histogram(
            "kvstore_router_pd_prefill_seconds",
            "Time from sending a prefill to its answer",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )

    async def run(
        self, request: Request, parsed: ParsedBody, prompt_tokens: int
    ) -> dict[str, Any] | None:
        """Prefill ``parsed`` (``request``'s body); the decode body, or ``None`` if it failed."""
        body = parsed.value
        data = parsed.encode(prefill_body(body))
        started = time.perf_counter()
        reason, detail = "unreachable", "no prefill replica"
        for replica in self.scorer.choose([], prompt_tokens, {}).ranked:
            self.scorer.dispatched(replica, [], prompt_tokens)
            try:
                status, answer = await asyncio.wait_for(
                    post(replica.url, request, data), self.timeout_s
                )
                params = _transfer_params(status, answer)
            except UpstreamError as exc:  # nothing reached that engine: try the next one
                reason, detail = "unreachable", str(exc)
                continue
            except TimeoutError:
                reason, detail = "timeout", f"{replica.url}: no answer in {self.timeout_s} s"
                break
            except PrefillFailed as exc:
                reason, detail = exc.reason, f"{replica.url}: {exc}"
                break
            finally:
                self.scorer.prefilled(replica, prompt_tokens)
                self.scorer.finished(replica)
            self.prefills.labels(replica.url).inc()
            self.seconds.observe(time.perf_counter() - started)
            return decode_body(body, params)
        self.failures.labels(reason).inc()
        logger.warning("prefill failed (%s); the decode replica computes the prompt", detail)
        return None


def _transfer_params(status: int, answer: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill's answer (``{}`` if it has none)."""
    if status != 200:
        raise PrefillFailed("status", f"status {status}: {answer[:200]!r}")
    try:
        parsed = json.loads(answer)
    except ValueError as exc:
        raise PrefillFailed("bad_response", f"answer is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise PrefillFailed("bad_response", "answer is not a JSON object")
    params = parsed.get("kv_transfer_params")
    return params if isinstance(params, dict) else {}


async def post(url: str, request: Request, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` to ``request``'s path on the server at ``url``; its status and whole body.

    The client's own headers (say, ``Authorization``) go along. Raises :class:`UpstreamError` if
    the server cannot be reached or closes before answering.
    """
    reader, writer, head_lines = await send_upstream(
        url, "POST", request.target, request.headers, body
    )
    try:
        status_parts = head_lines[0].split(" ")
        status = int(status_parts[1]) if len(status_parts) > 1 and status_parts[1].isdigit() else 0
        chunked = any(
            name.strip().lower() == "transfer-encoding" and "chunked" in value.lower()
            for name, _, value in (line.partition(":") for line in head_lines[1:])
        )
        data = await reader.read()  # Connection: close: the end of the bytes ends the body
        return status, _unchunk(data) if chunked else data
    finally:
        writer.close()


def _unchunk(data: bytes) -> bytes:
    """The payload of a chunked-encoded body."""
    out, position = bytearray(), 0
    while True:
        end = data.find(b"\r\n", position)
        if end < 0:
            return bytes(out)
        try:
            size = int(data[position:end].split(b";")[0] or b"0", 16)
        except ValueError:  # not chunked after all: the JSON parse of what came says so
            return bytes(out)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        position = end + 2 + size + 2
