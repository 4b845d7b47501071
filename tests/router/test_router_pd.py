"""The router's P/D mode: prefill first (one token, not streamed), then decode with the prefill's
``kv_transfer_params``; a failed prefill never fails the request.

The router runs for real (``run_router`` on a real port, its settings through ``load_config``);
the engines are :class:`Engine`, test doubles in the style of tests/harness/fake_engine.py:
real HTTP servers answering OpenAI-shaped JSON, that log every request in one shared list so a
test can tell the order. Real vLLM engines doing the hand-off: tests/vllm_engine/test_pd_handoff.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.router.launch import build_router, run_router
from kvstore.router.pd import decode_body, prefill_body

PARAMS = {"kvstore_saved_chunks": 3}


class Engine:
    """A fake OpenAI server named ``name``; every request goes to ``log`` as (name, body)."""

    def __init__(
        self,
        name: str,
        log: list[tuple[str, dict[str, Any]]],
        *,
        status: int = 200,
        delay_s: float = 0.0,
        answer: bytes | None = None,
    ) -> None:
        self.name, self.status, self.delay_s = name, status, delay_s
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                log.append((engine.name, body))
                time.sleep(engine.delay_s)  # sleep: the engine's work, as slow as asked
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(3):
                        data = f"data: {engine.name}-{i}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                payload = answer
                if payload is None:
                    choice = {"text": f"from {engine.name}", "index": 0}
                    params = PARAMS if engine.name.startswith("prefill") else None
                    payload = json.dumps({"choices": [choice], "kv_transfer_params": params})
                    payload = payload.encode()
                self.send_response(engine.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RouterThread:
    """``run_router`` on its own event loop in a thread, configured through ``env``."""

    def __init__(self, env: dict[str, str]) -> None:
        config = load_config(None, overrides={"router.listen": "127.0.0.1:0"}, env=env)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.url = ""

        def on_ready(url: str) -> None:
            self.url = url
            ready.set()

        def serve() -> None:
            self.task = self.loop.create_task(run_router(config, on_ready))
            with contextlib.suppress(asyncio.CancelledError):
                self.loop.run_until_complete(self.task)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the router did not start"

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, data

    def metric(self, series: str) -> float:
        """The value of one series (name and labels as exported) on the router's /metrics."""
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(series + " ")
        ]
        return values[0] if values else 0.0

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


def _env(prefill: list[str], decode: list[str], **more: str) -> dict[str, str]:
    return {
        "KVSTORE_ROUTER_PREFILL": ",".join(f"{url}=p{i}" for i, url in enumerate(prefill)),
        "KVSTORE_ROUTER_DECODE": ",".join(f"{url}=d{i}" for i, url in enumerate(decode)),
        **more,
    }


@pytest.fixture()
def log() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture()
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


REQUEST = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 9, "stream": True, "n": 1}


def test_prefill_runs_first_with_one_token_then_decode_streams_with_its_params(
    log: list[tuple[str, dict[str, Any]]], engines: list[Engine]
) -> None:
    engines += [Engine("prefill", log, delay_s=0.2), Engine("decode", log)]
    router = RouterThread(_env([engines[0].url], [engines[1].url]))
    try:
        body = {**REQUEST, "stream_options": {"include_usage": True}, "min_tokens": 2}
        status, data = router.post("/v1/completions", body)
        assert status == 200
        assert data.decode() == "".join(f"data: decode-{i}\n\n" for i in range(3))
        assert [name for name, _ in log] == ["prefill", "decode"]
        pre, dec = log[0][1], log[1][1]
        assert pre["prompt"] == body["prompt"] and pre["max_tokens"] == 1
        assert pre["stream"] is False and "stream_options" not in pre and "min_tokens" not in pre
        assert dec == {**body, "kv_transfer_params": PARAMS}  # the original, plus the params
        assert router.metric(f'kvstore_router_pd_prefills_total{{replica="{engines[0].url}"}}') == 1
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("reason", "engine"),
    [
        ("status", {"status": 500}),
        ("timeout", {"delay_s": 2.0}),
        ("bad_response", {"answer": b"<html>not json</html>"}),
        ("unreachable", None),
    ],
)
def test_a_failed_prefill_sends_the_original_request_to_decode_and_counts_it(
    log: list[tuple[str, dict[str, Any]]],
    engines: list[Engine],
    reason: str,
    engine: dict[str, Any] | None,
) -> None:
    engines.append(Engine("decode", log))
    if engine is None:
        prefill_url = _closed_port_url()
    else:
        engines.append(Engine("prefill", log, **engine))
        prefill_url = engines[-1].url
    env = _env([prefill_url], [engines[0].url], KVSTORE_ROUTER_PREFILL_TIMEOUT_S="0.5")
    router = RouterThread(env)
    try:
        status, data = router.post("/v1/completions", REQUEST)
        assert status == 200 and b"decode-2" in data
        decoded = [body for name, body in log if name == "decode"]
        assert decoded == [REQUEST]  # untouched: no kv_transfer_params
        failures = f'kvstore_router_pd_prefill_failures_total{{reason="{reason}"}}'
        assert router.metric(failures) == 1
    finally:
        router.stop()


def test_an_unreachable_prefill_replica_is_skipped_for_the_next(
    log: list[tuple[str, dict[str, Any]]], engines: list[Engine]
) -> None:
    engines += [Engine("prefill", log), Engine("decode", log)]
    router = RouterThread(_env([_closed_port_url(), engines[0].url], [engines[1].url]))
    try:
        for _ in range(2):  # whichever the load order tries first, both end at the live one
            assert router.post("/v1/completions", REQUEST)[0] == 200
        assert [name for name, _ in log] == ["prefill", "decode"] * 2
        assert all(body.get("kv_transfer_params") == PARAMS for n, body in log if n == "decode")
    finally:
        router.stop()


def test_decode_replicas_are_picked_by_load(
    log: list[tuple[str, dict[str, Any]]], engines: list[Engine]
) -> None:
    engines += [Engine("prefill", log), Engine("decode-a", log, delay_s=0.5)]
    engines.append(Engine("decode-b", log, delay_s=0.5))
    router = RouterThread(_env([engines[0].url], [engines[1].url, engines[2].url]))
    try:
        threads = [
            threading.Thread(target=router.post, args=("/v1/completions", REQUEST))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        # Both are in flight at once: the second goes to the decode replica without work.
        assert sorted(n for n, _ in log if n.startswith("decode")) == ["decode-a", "decode-b"]
    finally:
        router.stop()


def test_chat_prefill_caps_both_token_limits_and_keeps_the_clients_params() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}
    body["kv_transfer_params"] = {"theirs": 1}
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pre["messages"] == body["messages"]
    assert decode_body(body, PARAMS)["kv_transfer_params"] == {"theirs": 1, **PARAMS}
    assert body["max_completion_tokens"] == 50  # the original is not changed


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVSTORE_ROUTER_PREFILL": "http://a:1=n"}, "router.decode is empty"),
        ({"KVSTORE_ROUTER_DECODE": "http://a:1=n"}, "router.prefill is empty"),
        (
            {
                "KVSTORE_ROUTER_PREFILL": "http://a:1=n",
                "KVSTORE_ROUTER_DECODE": "http://b:1=m",
                "KVSTORE_ROUTER_REPLICAS": "http://c:1=o",
            },
            "router.replicas: cannot use it with",
        ),
        (
            {"KVSTORE_ROUTER_PREFILL": "http://a:1=n", "KVSTORE_ROUTER_DECODE": "http://a:1=m"},
            "both name",
        ),
        (
            {"KVSTORE_ROUTER_PREFILL": "a:1", "KVSTORE_ROUTER_DECODE": "http://b:1=m"},
            "router.prefill: cannot use 'a:1'",
        ),
    ],
)
def test_pd_settings_errors_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_router(load_config(None, env=env))
    assert "\n" not in str(info.value)


def test_pd_mode_needs_no_namespace_and_routes_decode_by_load() -> None:
    env = {"KVSTORE_ROUTER_PREFILL": "http://a:1=n", "KVSTORE_ROUTER_DECODE": "http://b:1=m"}
    router, client = build_router(load_config(None, env=env))
    assert client is None and router.keys is None and router.prefill is not None
    assert [r.url for r in router.scorer.replicas] == ["http://b:1"]
    assert [r.url for r in router.prefill.scorer.replicas] == ["http://a:1"]
    with pytest.raises(ConfigError, match=r"set cluster\.url"):
        build_router(load_config(None, env={"KVSTORE_ROUTER_REPLICAS": "http://b:1=m"}))
