"""Shared helpers of the benchmark scripts: servers to measure against, timing, tables.

Benchmarks run on a small shared machine, so every helper here serves one rule: measure each
path side by side with its baseline in the same run, interleaved, and report distributions
(median / p90 / p99 / max), never a single best run.

* :func:`free_port` picks a free loopback port.
* :func:`kvstore_server` and :func:`redis_server` are context managers that start a server
  subprocess on a free loopback port, wait until it answers, and always stop it (SIGTERM, then
  SIGKILL), even when the benchmark fails. On Linux the children also die with the benchmark
  process if it is killed outright.
* :func:`exit_on_sigterm` turns SIGTERM into ``SystemExit`` so that ``finally`` blocks (and so the
  context managers above) run when a benchmark is terminated.
* :func:`run_interleaved` times several cases round-robin, rotating their order every round.
* :func:`run_engine` (and :func:`engine_or_exit`) runs one vLLM engine process over a set of
  prompts (``tests/vllm_engine/engine_runner.py``), for the TTFT benchmarks.
* :func:`reap` waits for a child that ends by itself (a benchmark's peer process), or kills it.
* :class:`KeySource` hands out fresh keys; :func:`timed` times one call; :func:`check` raises
  :class:`BenchmarkError` when a path returned wrong data (its timings would mean nothing);
* :func:`summarize`, :func:`percentile` and :func:`markdown_table` turn samples into tables;
  :func:`machine_info` records what the figures were measured on.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from kvstore import KVStoreClient
from kvstore.keys import KEY_BYTES

__all__ = [
    "GB",
    "BenchmarkError",
    "KeySource",
    "ServerProcess",
    "Summary",
    "check",
    "engine_or_exit",
    "exit_on_sigterm",
    "free_port",
    "kvstore_server",
    "launchers",
    "machine_info",
    "markdown_table",
    "percentile",
    "reap",
    "redis_server",
    "run_engine",
    "run_interleaved",
    "summarize",
    "timed",
]

#: Throughput is reported in decimal gigabytes per second, as in ``DESIGN.md``.
GB = 1e9

#: The vLLM engine process the TTFT benchmarks run, one per configuration measured.
ENGINE_RUNNER = Path(__file__).resolve().parents[1] / "tests" / "vllm_engine" / "engine_runner.py"

_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def launchers(hosts: tuple[Any, Any] | None) -> tuple[Any, Any, str]:
    """``(popen, run, address)`` of a two-process benchmark: its listening side at ``address``,
    here or in ``hosts[0]`` (a ``harness.netns_hosts.Host``), the other here or in ``hosts[1]``."""
    if hosts is None:
        return subprocess.Popen, subprocess.run, "127.0.0.1"
    return hosts[0].popen, hosts[1].run, hosts[0].address


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit`` in the main thread, so cleanup code runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _die_with_parent() -> None:
    """``preexec_fn``: ask Linux to SIGTERM the child when the benchmark process dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ServerProcess:
    """A running server subprocess and where to reach it."""

    name: str
    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path

    @property
    def target(self) -> str:
        """``HOST:PORT``."""
        return f"{self.host}:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's combined stdout/stderr log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise ``RuntimeError`` with the log tail if the server has exited."""
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with status {code}:\n{self.log_tail()}")


def _spawn(name: str, argv: Sequence[str], log_path: Path, host: str, port: int) -> ServerProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = log_path.open("wb")
    try:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    finally:
        log.close()  # the child holds its own descriptor
    return ServerProcess(name, process, host, port, log_path)


def _stop(server: ServerProcess) -> None:
    """SIGTERM, wait, then SIGKILL: the server is gone when this returns."""
    process = server.process
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def reap(process: subprocess.Popen[Any], timeout: float = _STOP_TIMEOUT_S) -> None:
    """Wait for a child that ends by itself (a benchmark peer); kill it if it does not."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_ready(server: ServerProcess, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        server.check_alive()
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{server.name} not ready after {timeout:.0f}s:\n{server.log_tail()}"
            )
        time.sleep(0.05)


@contextlib.contextmanager
def kvstore_server(
    *,
    dram_capacity: str = "1GiB",
    nvme_capacity: str = "2GiB",
    nvme: bool = True,
    max_block_bytes: str | None = None,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    log_level: str = "WARNING",
    ready_timeout: float = _READY_TIMEOUT_S,
) -> Iterator[ServerProcess]:
    """Run ``kvstore serve`` (this interpreter, ``-m kvstore.cli``) on a free loopback port.

    The nvme tier (when ``nvme``) lives in a fresh temporary directory, removed afterwards.
    ``dram_capacity="0"`` disables the dram tier, so every block is stored in and served from
    nvme. Yields once the server has printed ``kvstore serving on ADDR``.
    """
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    server: ServerProcess | None = None
    try:
        port = free_port(host)
        argv = [
            sys.executable,
            "-m",
            "kvstore.cli",
            "serve",
            "--listen",
            f"{host}:{port}",
            "--dram-capacity",
            dram_capacity,
            "--nvme-path",
            str(workdir / "nvme") if nvme else "",
            "--nvme-capacity",
            nvme_capacity,
            "--log-level",
            log_level,
            # Port 0: benchmarks run several servers at once (extra_args may override it).
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        if max_block_bytes is not None:
            argv += ["--max-block-bytes", max_block_bytes]
        argv += list(extra_args)
        server = _spawn("kvstore serve", argv, workdir / "server.log", host, port)
        marker = "kvstore serving on"

        def ready() -> bool:
            return marker in server.log_path.read_text(errors="replace")

        _wait_ready(server, ready, ready_timeout)
        yield server
    finally:
        if server is not None:
            _stop(server)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(
    *,
    executable: str = "redis-server",
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    ready_timeout: float = _READY_TIMEOUT_S,
) -> Iterator[ServerProcess]:
    """Run a throw-away ``redis-server`` on a free loopback port, without persistence.

    Started with ``--save '' --appendonly no`` in a temporary directory, removed afterwards.
    Yields once the server answers PING.
    """
    binary = shutil.which(executable) or executable
    workdir = Path(tempfile.mkdtemp(prefix="redis-bench-"))
    server: ServerProcess | None = None
    try:
        port = free_port(host)
        argv = [
            binary,
            "--port",
            str(port),
            "--bind",
            host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(workdir),
            *extra_args,
        ]
        server = _spawn("redis-server", argv, workdir / "redis.log", host, port)

        def ready() -> bool:
            try:
                with socket.create_connection((host, port), timeout=1.0) as sock:
                    sock.sendall(b"PING\r\n")
                    return sock.recv(64).startswith(b"+PONG")
            except OSError:
                return False

        _wait_ready(server, ready, ready_timeout)
        yield server
    finally:
        if server is not None:
            _stop(server)
        shutil.rmtree(workdir, ignore_errors=True)


def run_interleaved(
    cases: Mapping[str, Callable[[], float]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Call every case ``warmup + reps`` times, round-robin, and keep the last ``reps`` results.

    Each case returns the seconds of its own timed region (so it can do untimed setup and
    cleanup around it). The order of the cases rotates every round, so that noise from other
    work on the machine, and any case's after-effects on the next one, are spread over all.
    """
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + reps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = cases[name]()
            if round_index >= warmup:
                samples[name].append(seconds)
    return samples


def run_engine(
    name: str,
    workdir: Path,
    model: Path,
    prompts: Sequence[Sequence[int]],
    flags: Sequence[str],
    timeout_s: float,
) -> tuple[dict[str, Any] | None, str]:
    """Run :data:`ENGINE_RUNNER` once: ``model`` over ``prompts`` (one token each), with its
    other ``flags`` (``--max-model-len`` and the connector's); its JSON output (``None`` where
    it exited non-zero) and its log. Files go in ``workdir`` under ``name``; the line printed
    says how long it took."""
    prompts_file = workdir / f"{name}.prompts.json"
    prompts_file.write_text(json.dumps([list(p) for p in prompts]))
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    command = [
        sys.executable,
        str(ENGINE_RUNNER),
        *("--model", str(model), "--prompts", str(prompts_file), "--out", str(out)),
        *("--max-tokens", "1"),
        *flags,
    ]
    print(f"  {name} ...", end="", flush=True)
    started = time.monotonic()
    with log.open("wb") as sink:
        code = subprocess.run(
            command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s
        ).returncode
    print(f" {time.monotonic() - started:.0f} s (exit {code})", flush=True)
    text = log.read_text(errors="replace")
    return (json.loads(out.read_text()) if code == 0 else None), text


def engine_or_exit(name: str, run: tuple[dict[str, Any] | None, str]) -> tuple[dict[str, Any], str]:
    """A :func:`run_engine` ``run`` of engine ``name`` that succeeded, else the end of the
    benchmark with its log's last lines."""
    result, text = run
    if result is None:
        sys.exit(f"engine {name} failed:\n" + "\n".join(text.splitlines()[-40:]))
    return result, text


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, like ``numpy.percentile``."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    """The distribution of one case's samples."""

    count: int
    median: float
    p90: float
    p99: float
    max: float
    min: float


def summarize(values: Sequence[float]) -> Summary:
    """Median, p90, p99, max and min of ``values``."""
    return Summary(
        count=len(values),
        median=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        max=max(values),
        min=min(values),
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A GitHub markdown table; ``align`` has one of ``l``/``r`` per column (default: ``l`` first,
    ``r`` for the rest)."""
    align = align or "l" + "r" * (len(headers) - 1)
    rules = [":---" if a == "l" else "---:" for a in align]
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join(rules) + " |",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _command_version(argv: Sequence[str]) -> str:
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unavailable"
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0] if result.returncode == 0 and lines else "unavailable"


def machine_info(
    distributions: Sequence[str] = (), commands: Mapping[str, Sequence[str]] | None = None
) -> dict[str, str]:
    """What a result was measured on: CPU, cores, load, Python, package and tool versions."""
    info = {
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "load average (1/5/15 min)": " / ".join(f"{v:.2f}" for v in os.getloadavg()),
        "python": platform.python_version(),
        "os": platform.platform(),
    }
    for name in distributions:
        info[name] = _version(name)
    for name, argv in (commands or {}).items():
        info[name] = _command_version(argv)
    return info


class BenchmarkError(RuntimeError):
    """A path returned wrong or missing data: its timings would be meaningless."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`BenchmarkError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise BenchmarkError(message)


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``call``."""
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


class KeySource:
    """Fresh random 16-byte keys (never reused, so a put always stores)."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def take(self, count: int) -> list[bytes]:
        """``count`` new keys."""
        return [self._rng.bytes(KEY_BYTES) for _ in range(count)]


def fresh_put_case(
    client: KVStoreClient, blocks: Sequence[Any], fresh: KeySource, name: str
) -> Callable[[], float]:
    """A case timing one put of ``blocks`` under new keys (deleted again, untimed)."""

    def case() -> float:
        keys = fresh.take(len(blocks))
        seconds, result = timed(lambda: client.put(keys, blocks))
        check(result.stored == len(blocks), f"{name}: stored {result.stored} of {len(blocks)}")
        client.delete(keys)
        return seconds

    return case
