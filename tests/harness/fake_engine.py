"""A stand-in for a vLLM OpenAI server, for tests of ``kvstore router``.

A *test double*: real vLLM replicas cannot be started cheaply in the default suite (the
two-replica end-to-end test with real engines belongs to the vLLM suite). This is a real HTTP
server on a real port that answers OpenAI-shaped JSON, streams server-sent events in chunked
framing when asked to, and records every request it got, so a test can tell where the router
sent what.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeEngine", "stream_events"]


def stream_events(name: str, count: int) -> bytes:
    """The SSE body the engine named ``name`` streams for a request (``count`` events)."""
    events = [
        "data: " + json.dumps({"object": "text_completion", "choices": [{"text": f"{name}-{i}"}]})
        for i in range(count)
    ]
    return ("\n\n".join([*events, "data: [DONE]"]) + "\n\n").encode()


class FakeEngine:
    """One fake replica named ``name`` on 127.0.0.1; ``delay_s`` before each answer (so that a
    burst is in flight at once). With ``raw``, POST bodies are kept as bytes in :attr:`bodies`,
    not parsed (a test of the router's memory and latency needs none of the engine's)."""

    def __init__(self, name: str, delay_s: float = 0.0, *, raw: bool = False) -> None:
        self.name = name
        self.delay_s = delay_s
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.bodies: list[bytes] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                engine.requests.append((self.path, {}))
                if self.path == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": "fake", "owner": engine.name}]}
                    )
                else:
                    self._send(404, {"error": "no such path"})

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if raw:
                    engine.bodies.append(data)
                    self._send(200, {"object": "text_completion", "choices": []})
                    return
                body = json.loads(data)
                engine.requests.append((self.path, body))
                time.sleep(engine.delay_s)  # sleep: the engine's work, as slow as asked
                if not body.get("stream"):
                    choice = {"text": f"from {engine.name}", "index": 0}
                    self._send(200, {"object": "text_completion", "choices": [choice]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in stream_events(engine.name, 5).split(b"\n\n")[:-1]:
                    data = event + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    time.sleep(0.02)  # separate writes: the router must pass each through
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def prompts(self) -> list[Any]:
        """The ``prompt`` of every completion request it got, in order."""
        return [body.get("prompt") for path, body in self.requests if path == "/v1/completions"]

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
