"""A store restarted under a running vLLM engine gets the engine's saves again within 2 s.

One API server (the README's command, as :mod:`test_openai_server` runs it) answers distinct
prompts back to back, each of whole chunks that its connector saves. The store is stopped for
8 s (long enough for gRPC's default reconnect backoff to have grown past 3 s) and restarted on
the same address and data directory. From its ``serving on`` the store's block count is
watched: the first new block must land within 2 s, and every request that started after that
must have had its chunks saved. The lost saves after ``serving on`` are counted in the failure
message.

Needs vLLM's CPU build; skipped without it unless ``KVSTORE_REQUIRE_VLLM=1``. Runtime: about
a minute and a half on two cores, mostly the start-up of the API server.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from harness.polling import poll_value
from harness.serve import ServerProcess
from harness.vllm_readme_server import CHUNK, PROMPT_WORDS, ReadmeApiServer
from harness.vllm_readme_server import model as model  # the fixture, shared

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

OUTAGE_S = 8.0
RESUME_WITHIN_S = 2.0
WATCH_S = 10.0


def _prompt(n: int) -> str:
    """A prompt of whole chunks whose first words (so every chunk key) are its own."""
    return f"request {n} " + " ".join(f"t{3 + (i * 37 + n) % 1000}" for i in range(PROMPT_WORDS))


class _Driver(threading.Thread):
    """Sends distinct prompts one after another until stopped; when each started."""

    def __init__(self, server: ReadmeApiServer, model: Path, first: int) -> None:
        super().__init__(daemon=True)
        self._server, self._model, self._next = server, model, first
        self.started: list[float] = []
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.started.append(time.monotonic())
                self._server.complete(self._model, _prompt(self._next))
                self._next += 1
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_saves_resume_within_two_seconds_of_a_restarted_stores_serving_on(
    tmp_path: Path, model: Path
) -> None:
    workdir = tmp_path / "store"
    store = ServerProcess(workdir, settings={"dram.capacity": "1GiB"}, name="store").start()
    server = ReadmeApiServer("engine", tmp_path, model, store.target)
    driver: _Driver | None = None
    try:
        tokens = int(server.complete(model, _prompt(0))["usage"]["prompt_tokens"])
        chunks = tokens // CHUNK
        assert chunks >= 2, server.tail()
        poll_value(lambda: store.stats()["blocks"] >= chunks, "the first prompt's chunks stored")

        driver = _Driver(server, model, first=1)
        driver.start()
        time.sleep(1.0)  # sleep: the store stops at some moment into the driver's requests
        store.stop()
        # sleep: the outage; the engine keeps answering (recomputing), its saves failing
        time.sleep(OUTAGE_S)
        store.start(same_address=True)
        serving = time.monotonic()
        before = store.stats()["blocks"]
        resumed: float | None = None
        while time.monotonic() - serving < WATCH_S:
            if resumed is None and store.stats()["blocks"] > before:
                resumed = time.monotonic() - serving
            time.sleep(0.05)
        driver.stopping.set()
        driver.join(timeout=300)
        assert driver.error is None, f"{driver.error!r}\n{server.tail()}"
        since = [t - serving for t in driver.started if t >= serving]
        # Let the last request's puts land (all of them, or 10 s for any lost), then count
        # what the restarted store got.
        expected = len(since) * chunks
        give_up = time.monotonic() + 10.0
        while store.stats()["blocks"] - before < expected and time.monotonic() < give_up:
            time.sleep(0.05)
        saved = store.stats()["blocks"] - before
        lost_requests = max(expected - saved, 0) / chunks
        report = (
            f"first save {resumed} s after serving on; {len(since)} requests started after it "
            f"(at {[round(t, 2) for t in since]} s), {lost_requests:g} of them lost their saves"
        )
        print(report)
        assert resumed is not None and resumed < RESUME_WITHIN_S, report
        started_before_resume = sum(t < resumed for t in since)
        assert lost_requests <= started_before_resume, report
    finally:
        if driver is not None:
            driver.stopping.set()
        server.stop()
        store.close()
