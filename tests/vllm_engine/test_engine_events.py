"""A real vLLM engine's KV events make its prefix cache tier ``local`` in the cluster index.

One engine (the suite's tiny model, the kvstore connector, ``kv_events_config`` publishing on
ZMQ) beside a real ``kvstore serve`` node that consumes its events (``cluster.engine_events``)
and a real redis-server holding the index. After a prompt of three whole chunks and a partial
one, :meth:`ClusterIndex.holders` lists exactly the three whole chunks as local for that node,
under the keys the connector computes (its own ``make_hasher`` over the namespace it logged).

Needs vLLM's CPU build; skipped without it unless ``KVSTORE_REQUIRE_VLLM=1``. Runtime: about a
minute, mostly the engine's start-up.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from harness.cluster_nodes import holders
from harness.ports import free_port
from harness.redis_server import RedisServer
from harness.serve import ServerProcess
from harness.vllm_fleet import build_model

from kvstore import Namespace
from kvstore.integrations.vllm.common import ConnectorSettings, make_hasher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

HERE = Path(__file__).parent
CHUNK = 256
START_TIMEOUT_S = 300


def wait_for(condition: Callable[[], bool], what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {within} s"
        time.sleep(0.1)


class EventsEngine:
    """``events_engine.py`` in a subprocess: one prompt per stdin line, results on stdout."""

    def __init__(self, workdir: Path, model: Path, target: str, events: str) -> None:
        self.log = workdir / "engine.log"
        command = [
            sys.executable,
            str(HERE / "events_engine.py"),
            "--model",
            str(model),
            "--target",
            target,
            "--events",
            events,
            "--chunk-size",
            str(CHUNK),
            "--workdir",
            str(workdir),
        ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
            )
        self.results = 0

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"the engine exited:\n{self.text()[-4000:]}")
            return "READY" in self.text()

        wait_for(ready, "the engine's start-up", START_TIMEOUT_S)

    def namespace(self) -> Namespace:
        """The connector's base namespace, from its start-up line ``namespace Namespace(...)``."""
        match = re.search(r"namespace (Namespace\(.*\))$", self.text(), re.MULTILINE)
        assert match, "the connector did not log its namespace"
        call = ast.parse(match.group(1), mode="eval").body
        assert isinstance(call, ast.Call)
        return Namespace(**{k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg})

    def generate(self, tokens: list[int]) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write((json.dumps(tokens) + "\n").encode())
        stdin.flush()
        self.results += 1
        wait_for(lambda: self.text().count("RESULT ") >= self.results, "a generation", 120)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return build_model(tmp_path)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def test_engine_prefix_cache_is_local_in_the_index(
    tmp_path: Path, model: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = f"127.0.0.1:{free_port()}"
    port = free_port()
    secret = "engine-events-vllm"
    monkeypatch.setenv("KVSTORE_HASH_SECRET", secret)  # the connector and the node share it
    engine = EventsEngine(tmp_path, model, target, f"tcp://*:{port}")
    node: ServerProcess | None = None
    try:
        engine.wait_ready()
        base = engine.namespace()
        per_request = ("lora_id", "cache_salt", "tp_rank")
        fields = {
            f.name: getattr(base, f.name)
            for f in dataclasses.fields(base)
            if f.name not in per_request
        }
        node = ServerProcess(
            tmp_path / "node",
            listen=target,
            settings={
                "dram.capacity": "512MiB",
                "cluster.enabled": True,
                "cluster.url": redis_server.url,
                "cluster.node_id": "beside-engine",
                "cluster.publish_interval_s": 0.05,
                "cluster.engine_events": f"tcp://127.0.0.1:{port}",
                "keys.namespace": json.dumps(fields),
                "keys.chunk_size": CHUNK,
            },
            env={"KVSTORE_HASH_SECRET": secret},  # not inherited: the launcher's env is clean
        ).start()
        # The connector's own naming of this engine's unsalted, non-LoRA requests.
        settings = ConnectorSettings.from_extra_config({"target": target, "chunk_size": CHUNK})
        hasher = make_hasher(settings, base, "", "")
        rng = random.Random(20261124)

        # Warm-up prompts until the node hears the engine (a PUB socket drops what it sends
        # before the subscriber has joined).
        def heard() -> bool:
            warm = [rng.randrange(3, 1000) for _ in range(CHUNK + 10)]
            engine.generate(warm)
            # A second for this prompt's events to reach the index; then the next prompt.
            give_up = time.monotonic() + 1.0
            while time.monotonic() < give_up:
                if "beside-engine" in holders(redis_server.url, hasher.keys(warm)):
                    return True
                time.sleep(0.05)
            return False

        wait_for(heard, "the node hearing the engine's events", 120)

        prompt = [rng.randrange(3, 1000) for _ in range(3 * CHUNK + 100)]
        keys = hasher.keys(prompt + [1] * (CHUNK - 100))  # 3 whole chunks and the partial 4th
        engine.generate(prompt)

        def local() -> list[str]:
            found = holders(redis_server.url, keys).get("beside-engine")
            return found.tiers if found is not None else []

        wait_for(lambda: local() == ["local"] * 3 + [""], "the prompt's whole chunks as local", 30)
    finally:
        engine.stop()
        if node is not None:
            node.close()
    assert "engine events: connected to" in node.stderr()
