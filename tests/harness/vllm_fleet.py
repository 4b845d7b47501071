"""A two-replica fleet on this machine: real vLLM CPU API servers, each with the kvstore
connector pointed at its own ``kvstore serve`` node (cluster index on, distinct node ids, one
real redis-server), and ``kvstore router`` subprocesses in front of them.

Used by ``tests/vllm_engine/test_router_fleet.py`` and ``benchmarks/bench_route_replay.py``.
Start-up cost is the two API servers (they start side by side); everything else takes a second.

The chunk size is set in one place, as a deployment should: the nodes' ``keys.chunk_size``. The
connectors set none (they ask their node), and the routers have no key settings (they read the
scheme the nodes publish in the cluster index, with the namespace the connectors declared). The
fleet still reads the connector's namespace from its start-up log line (a logging config makes
vLLM's processes print kvstore's INFO lines), for tests that compute chunk keys themselves.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.ports import free_port
from harness.redis_server import RedisServer
from harness.router import http_exchange, launch_router
from harness.serve import ServerProcess, without_settings
from harness.vllm_api_server import (
    ApiServerProcess,
    connector_command,
    server_env,
    wait_all_healthy,
)

if TYPE_CHECKING:
    from kvstore.cluster import Layout

__all__ = [
    "ApiServer",
    "Fleet",
    "Node",
    "Reply",
    "RouterProcess",
    "build_model",
]

#: The vLLM suite's folder, where the tiny model's script lives.
VLLM_TESTS = Path(__file__).resolve().parents[1] / "vllm_engine"
#: Tokens per chunk: the nodes' ``keys.chunk_size`` (not the default 256, so that a part of
#: the fleet that fell back to the default would show).
CHUNK = 128
_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"}
    },
    "handlers": {
        "out": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "kvstore": {"handlers": ["out"], "level": "INFO", "propagate": False},
    },
}


def build_model(directory: Path, **sizes: int) -> Path:
    """The suite's tiny random Llama, built in a subprocess (torch stays out of this one)."""
    path = directory / "tiny-llama"
    flags = [f"--{name}={value}" for name, value in sizes.items()]
    subprocess.run(
        [sys.executable, str(VLLM_TESTS / "tiny_model.py"), str(path), *flags],
        check=True,
        timeout=300,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return path


class Node(ServerProcess):
    """``kvstore serve`` with the cluster index on and ``keys.chunk_size = chunk`` (each boot
    starts empty, on the same port: the engine's connector reconnects to it)."""

    def __init__(self, workdir: Path, node_id: str, index_url: str, chunk: int = CHUNK) -> None:
        settings = {
            "dram.capacity": "1GiB",
            "keys.chunk_size": chunk,
            "cluster.enabled": True,
            "cluster.url": index_url,
            "cluster.node_id": node_id,
            "cluster.publish_interval_s": 0.05,
        }
        super().__init__(workdir / node_id, settings=settings, name=node_id)
        self.node_id = node_id
        self.index_url = index_url
        self.start()

    @property
    def boots(self) -> int:
        """How many times it was started."""
        return self.starts

    def start(self, *, same_address: bool = True) -> Node:
        """Start (again, on the same port), on a fresh nvme directory per boot: a restarted node
        holds nothing of its last life."""
        self.nvme_path = self.workdir / f"nvme-{self.starts + 1}"
        super().start(same_address=same_address)
        return self

    def metrics(self, pattern: str) -> list[str]:
        """The non-zero samples of the node's ``/metrics`` whose line matches ``pattern``."""
        if not self.metrics_url:
            return ["(no metrics address in the log)"]
        url = self.metrics_url.removeprefix("http://")
        host, _, rest = url.partition("/")
        connection = http.client.HTTPConnection(host, timeout=5)
        try:
            connection.request("GET", "/" + rest)
            text = connection.getresponse().read().decode(errors="replace")
        finally:
            connection.close()
        return [
            line
            for line in text.splitlines()
            if not line.startswith("#") and re.search(pattern, line) and not line.endswith(" 0.0")
        ]


class ApiServer(ApiServerProcess):
    """vLLM's OpenAI API server (CPU) with the kvstore connector, in its own process group; the
    connector's config names no chunk size: it takes its node's."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        model: Path,
        target: str,
        max_model_len: int,
        cpu: str,
    ) -> None:
        port = free_port()
        logging_config = workdir / "vllm-logging.json"
        logging_config.write_text(json.dumps(_LOGGING))
        command = connector_command(model, port, target, max_model_len=max_model_len)
        env = server_env(
            # One core each: the two replicas do not fight over the same cores.
            VLLM_CPU_OMP_THREADS_BIND=cpu,
            VLLM_LOGGING_CONFIG_PATH=str(logging_config),
        )
        super().__init__(name, command, workdir / f"{name}.log", env, port)

    def namespace_json(self) -> str:
        """The connector's base namespace, from its start-up log line, as JSON (what the node
        publishes for the router; tests name chunk keys with it)."""
        found = re.search(r"namespace Namespace\((.*)\)\s*$", self.log.read_text(), re.MULTILINE)
        if not found:
            raise RuntimeError(f"{self.name} logged no kvstore namespace:\n{self.tail()}")
        fields = {
            name: ast.literal_eval(value)
            for name, value in re.findall(r"(\w+)=('[^']*'|-?\d+)", found.group(1))
        }
        for name in ("lora_id", "cache_salt", "tp_rank"):
            fields.pop(name, None)
        return json.dumps(fields)

    def complete(self, model: str, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
        """One greedy completion straight to this server (no router); the response's JSON."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        return self.post_completion(body)


@dataclass
class Reply:
    """One completion through the router: who answered, usage, time to first byte of body."""

    status: int
    replica: str
    body: dict[str, Any]
    ttft_s: float
    total_s: float
    raw: bytes = field(repr=False, default=b"")

    @property
    def prompt_tokens(self) -> int:
        """``usage.prompt_tokens``."""
        return int(self.body["usage"]["prompt_tokens"])

    @property
    def cached_tokens(self) -> int:
        """``usage.prompt_tokens_details.cached_tokens`` (engine prefix cache + kvstore loads)."""
        details = self.body["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


class RouterProcess:
    """``kvstore router`` in a subprocess in front of ``replicas`` (``URL=NODE_ID``), with no
    key settings: it names chunks by the scheme the nodes publish in the index at
    ``index_url``."""

    def __init__(
        self,
        workdir: Path,
        replicas: Sequence[str],
        index_url: str,
        *,
        policy: str = "kv",
        env: dict[str, str] | None = None,
    ) -> None:
        # The engines' connectors hash with $KVSTORE_HASH_SECRET: the router must too.
        environ = without_settings({"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **(env or {})})
        if "KVSTORE_HASH_SECRET" in os.environ:  # the fleet's key secret, which the router needs
            environ.setdefault("KVSTORE_HASH_SECRET", os.environ["KVSTORE_HASH_SECRET"])
        flags = ["--policy", policy]
        for replica in replicas:
            flags += ["--replica", replica]
        flags += ["--index-url", index_url]
        self.log_path = workdir / f"router-{policy}.log"
        self.proc, self.log, self.host, self.port = launch_router(flags, environ, self.log_path)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """One plain HTTP exchange (an engine's answer may take minutes on a loaded CPU)."""
        return http_exchange(self.host, self.port, method, path, body, timeout=300)

    def complete(self, model: str, prompt: list[int], max_tokens: int = 2, **extra: Any) -> Reply:
        """A greedy streamed completion of token ids; usage comes in the last event."""
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        connection = http.client.HTTPConnection(self.host, self.port, timeout=300)
        try:
            started = time.perf_counter()
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            first = response.read1(1 << 16)  # the first chunk: time to first token
            ttft = time.perf_counter() - started
            raw = first + response.read()
            total = time.perf_counter() - started
            replica = response.getheader("x-kvstore-replica") or ""
            status = response.status
        finally:
            connection.close()
        usage: dict[str, Any] = {}
        if status == 200:
            for line in raw.decode(errors="replace").splitlines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event
        return Reply(status, replica, usage, ttft, total, raw)

    def log_text(self) -> str:
        """What the router logged so far."""
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of the router's ``/metrics`` (0 when absent)."""
        _, text = self.call("GET", "/metrics")
        series = name + "{" + labels + "}" if labels else name
        found = re.search("^" + re.escape(series) + r" (\S+)$", text.decode(), re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Fleet:
    """Redis, nodes ``node-0``/``node-1``, one API server beside each, routers on demand."""

    def __init__(
        self, workdir: Path, model: Path, max_model_len: int = 2048, chunk: int = CHUNK
    ) -> None:
        self.workdir = workdir
        self.chunk = chunk
        self.model = model
        self.redis = RedisServer(workdir / "redis").start()
        self.nodes: list[Node] = []
        self.servers: list[ApiServer] = []
        self.routers: list[RouterProcess] = []
        try:
            for number in range(2):
                self.nodes.append(Node(workdir, f"node-{number}", self.redis.url, chunk))
            cores = os.cpu_count() or 1
            for number, node in enumerate(self.nodes):
                cpu = str(number % cores)
                self.servers.append(
                    ApiServer(f"vllm-{number}", workdir, model, node.target, max_model_len, cpu)
                )
            wait_all_healthy(self.servers)
            self.namespace = self.servers[0].namespace_json()
        except BaseException:
            self.close()
            raise

    @property
    def replicas(self) -> list[str]:
        """``URL=NODE_ID`` of each replica, in order."""
        return [f"{s.url}={n.node_id}" for s, n in zip(self.servers, self.nodes, strict=True)]

    def router(self, policy: str = "kv", env: dict[str, str] | None = None) -> RouterProcess:
        """A new router in front of both replicas (stopped by :meth:`close`)."""
        router = RouterProcess(
            self.workdir,
            self.replicas,
            self.redis.url,
            policy=policy,
            env=env,
        )
        self.routers.append(router)
        return router

    def diagnose(self, keys: Sequence[bytes], layout: Layout) -> str:
        """Why the index answers what it does for chunk ``keys`` (under ``layout``), for a
        failure message: what Redis holds raw (the keys' entries, every node's lease, its TTL
        and epoch counter), each node's block count, store metrics and log tail, and each
        replica's kvstore connector lines."""
        parts: list[str] = []
        try:
            redis = self.redis.client()
            ours = self.redis._process
            answering = redis.info("server")["process_id"]
            parts.append(
                f"redis-server: ours pid {ours.pid if ours else None} "
                f"running {ours is not None and ours.poll() is None}, answering pid {answering}"
            )
            for number, key in enumerate(keys):
                parts.append(f"redis entry {number}: {redis.hgetall(layout.entry(key))}")
            parts.append(f"redis nodes: {redis.smembers(layout.nodes)}")
            for node in self.nodes:
                name, lease = node.node_id, layout.lease(node.node_id)
                parts.append(
                    f"redis {name}: lease {redis.get(lease)!r} pttl {redis.pttl(lease)} "
                    f"epoch counter {redis.get(layout.epoch(name))!r} "
                    f"node {redis.hgetall(layout.node(name))}"
                )
        except Exception as exc:  # a diagnosis never hides the failure it explains
            parts.append(f"redis: {exc!r}")
        for node in self.nodes:
            try:
                alive = node.proc is not None and node.proc.poll() is None
                parts.append(f"{node.node_id} (boot {node.boots}, running {alive}):")
                if alive:
                    parts.append(f"  blocks {node.stats()['blocks']}")
                    # Calls per operation, where blocks went, why reads missed.
                    pattern = r"_count\{|evictions|demotions|resident_blocks|misses|errors|shm_"
                    parts += ["  " + line for line in node.metrics(pattern)[:30]]
            except Exception as exc:
                parts.append(f"  stats: {exc!r}")
            lines = node.stderr().splitlines()
            parts += ["  | " + line[:300] for line in lines[-25:]]
        for server in self.servers:
            lines = server.log.read_text(errors="replace").splitlines()
            connector = [line for line in lines if "kvstore" in line]
            parts.append(f"{server.name} ({len(connector)} kvstore lines, the last 25):")
            parts += ["  | " + line[:300] for line in connector[-25:]]
        return "\n".join(parts)

    def close(self) -> None:
        """Stop everything this fleet started."""
        for router in self.routers:
            router.stop()
        for server in self.servers:
            server.stop()
        for node in self.nodes:
            node.close()
        self.redis.stop()
