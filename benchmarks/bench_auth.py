"""What TLS, bearer tokens and client certificates cost put, get_into and lookup, beside the same
paths without them, and what keyed integrity costs (``dram.verify_reads``, the nvme tier's MAC).

Exact command (repository root; about 2 minutes on 2 shared cores; needs the ``openssl``
command, which makes the throw-away certificates)::

    .venv/bin/python benchmarks/bench_auth.py --out benchmarks/results/auth

Writes ``auth.md`` (the report) and ``auth.json`` (every sample). One run starts, on free
loopback ports, ``kvstore serve`` processes with the same store settings (256 MiB of dram, no
nvme; every block stays in dram) that differ only in who may call them:

* ``plain``: no TLS, no authentication (the baseline);
* ``token``: ``--tokens-file`` (clients pass ``token=``);
* ``TLS``: ``--tls-cert``/``--tls-key`` (clients pass ``tls_ca=``);
* ``TLS+token``: both;
* ``mTLS``: TLS and ``--tls-client-ca`` (clients also pass ``tls_cert=``/``tls_key=``);

two more for keyed integrity: ``plain`` with ``dram.verify_reads = true``, and an nvme-only
server (dram capacity 0: every put is signed with the keyed MAC and every get verified); and a
second ``plain`` server, started last, as the A/A control: two identical servers differ by
several percent, so ``vs plain`` divides by the mean of both plain servers, and the control's own
ratio shows how far from 1.00 a ratio moves with no difference at all.

**Throughput, one client.** For 256 KiB and 1 MiB blocks, one call moves a batch of ``--batch``
blocks (8). Per security configuration: ``shm get_into`` (the default client: direct reads
through the published index), ``shm get_into, leased`` (``shm_direct_reads`` off: every read goes
through the server's lease path), ``shm put``, ``gRPC get_into`` and ``gRPC put`` (the same calls
held to ``data_plane="grpc"``); plus ``memcpy`` (``numpy.copyto`` of the batch: the ceiling). On
the shm path the credentials are checked once, on the gRPC ``DataPlane`` call that hands the
client the socket; the data itself never crosses gRPC. At 1 MiB, also the leased and direct
shm get_into of the ``verify_reads`` server and gRPC put / get_into of the nvme-only server.

**Lookup latency.** ``lookup`` of 1024 stored keys per configuration, over shm and over gRPC.

Every part runs ``--rounds`` rounds (3); within a round all cases of one size run interleaved,
round-robin with rotating order (:func:`_common.run_interleaved`). A ratio (``vs plain``,
``vs memcpy``) is computed per round from that round's medians, and the table gives the median
ratio over the rounds with its range: on a shared machine, a ratio from one round can be off by
tens of percent. GB = 10**9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import secrets
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' harness
from _cases import get_into_case, memcpy_case
from _common import (
    GB,
    BenchmarkError,
    KeySource,
    check,
    exit_on_sigterm,
    fresh_put_case,
    kvstore_server,
    machine_info,
    markdown_table,
    run_interleaved,
    summarize,
    timed,
)
from harness.certs import Pki, make_pki

from kvstore import KVStoreClient, Namespace
from kvstore.client.settings import ClientSettings
from kvstore.errors import KVStoreError

KiB = 1024
MiB = 1024**2
SIZES = {"256 KiB": 256 * KiB, "1 MiB": MiB}
NAMESPACE = Namespace(model="bench-auth")
CALL_TIMEOUT_S = 120.0
LOOKUP_KEYS = 1024

PLAIN, TOKEN, TLS, TLS_TOKEN, MTLS = "plain", "token", "TLS", "TLS+token", "mTLS"
#: A second server configured exactly as ``plain``, started last: the A/A control, which shows
#: how far two identical servers differ in this run (the noise floor of every ``vs plain``).
PLAIN_AGAIN = "plain again (control)"
SECURITY = (PLAIN, TOKEN, TLS, TLS_TOKEN, MTLS, PLAIN_AGAIN)
VERIFY, NVME = "plain, verify_reads on", "plain, nvme only (MAC)"
MEMCPY = "memcpy"
SHM_GET, SHM_LEASED, SHM_PUT = "shm get_into", "shm get_into, leased", "shm put"
GRPC_GET, GRPC_PUT = "gRPC get_into", "gRPC put"
PATHS = (SHM_GET, SHM_LEASED, SHM_PUT, GRPC_GET, GRPC_PUT)
BOUND = 0.10  # issue 12: auth and keyed integrity cost at most 10 % of shm get_into at 1 MiB


# -- certificates and servers ---------------------------------------------------------------------


@dataclass
class Config:
    """One server configuration: its ``kvstore serve`` flags and what its clients pass."""

    name: str
    server_args: list[str]
    client_args: dict[str, Any] = field(default_factory=dict)
    dram: str = "256MiB"
    nvme: bool = False


def configs(workdir: Path, pki: Pki, token: str) -> list[Config]:
    """The security configurations, then the two keyed-integrity ones."""
    tokens = workdir / "tokens"
    tokens.write_text(f"bench {hashlib.sha256(token.encode()).hexdigest()}\n")
    verify = workdir / "verify.toml"
    verify.write_text("[dram]\nverify_reads = true\n")
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    with_token = ["--tokens-file", str(tokens)]
    return [
        Config(PLAIN, []),
        Config(TOKEN, with_token, {"token": token}),
        Config(TLS, tls, {"tls_ca": pki.ca}),
        Config(TLS_TOKEN, tls + with_token, {"tls_ca": pki.ca, "token": token}),
        Config(
            MTLS,
            [*tls, "--tls-client-ca", str(pki.ca)],
            {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key},
        ),
        Config(VERIFY, ["--config", str(verify)]),
        Config(NVME, [], dram="0", nvme=True),
        Config(PLAIN_AGAIN, []),
    ]


def started(stack: contextlib.ExitStack, config: Config) -> dict[str, KVStoreClient]:
    """Start ``config``'s server (stopped by ``stack``); its clients by kind (``shm``,
    ``leased``, ``grpc``), after checking that a client without its credentials is refused."""
    server = stack.enter_context(
        kvstore_server(
            dram_capacity=config.dram,
            nvme=config.nvme,
            nvme_capacity="1GiB",
            extra_args=config.server_args,
        )
    )
    planes = {
        "grpc": ClientSettings(data_plane="grpc"),
        "shm": ClientSettings(data_plane="shm"),
        "leased": ClientSettings(data_plane="shm", shm_direct_reads=False),
    }
    if config.nvme:
        planes = {"grpc": planes["grpc"]}
    clients = {
        kind: stack.enter_context(
            KVStoreClient(
                server.target,
                namespace=NAMESPACE,
                timeout=CALL_TIMEOUT_S,
                settings=settings,
                **config.client_args,
            )
        )
        for kind, settings in planes.items()
    }
    if "token" in config.client_args or "tls_cert" in config.client_args:
        # The server enforces its credentials: the same client without them is refused.
        bare = {k: v for k, v in config.client_args.items() if k == "tls_ca"}
        with KVStoreClient(
            server.target, namespace=NAMESPACE, timeout=5.0, data_plane="grpc", **bare
        ) as anonymous:
            try:
                anonymous.lookup([bytes(16)])
            except KVStoreError:
                pass
            else:
                raise BenchmarkError(f"{config.name}: a client without credentials was served")
    return clients


# -- throughput -----------------------------------------------------------------------------------


def _verify(
    name: str, clients: dict[str, KVStoreClient], keys: list[bytes], blocks: list[Any]
) -> None:
    """Store ``blocks`` and check that every client reads back the same bytes on its plane."""
    writer = clients.get("shm", clients["grpc"])
    check(writer.put(keys, blocks).stored == len(keys), f"{name}: put did not store the batch")
    for kind, client in clients.items():
        buffers = [np.zeros_like(block) for block in blocks]
        check(client.get_into(keys, buffers) == [True] * len(keys), f"{name} {kind}: missed")
        check(
            all(np.array_equal(a, b) for a, b in zip(buffers, blocks, strict=True)),
            f"{name} {kind}: get_into differs",
        )
        expected = "grpc" if kind == "grpc" else "shm"
        check(client.data_plane == expected, f"{name} {kind}: on {client.data_plane}")


def throughput_cases(
    label: str,
    blocks: list[Any],
    keys: list[bytes],
    servers: dict[str, dict[str, KVStoreClient]],
) -> dict[str, Callable[[], float]]:
    """Every case of one block size, named ``CONFIG|PATH`` (and ``memcpy``)."""
    buffers = [np.empty_like(block) for block in blocks]
    fresh = KeySource(seed=len(blocks) * 7 + blocks[0].nbytes)

    memcpy = memcpy_case(buffers, blocks)

    def get_into(client: KVStoreClient, name: str) -> Callable[[], float]:
        return get_into_case(client, name, keys, buffers)

    cases: dict[str, Callable[[], float]] = {MEMCPY: memcpy}
    for config, clients in servers.items():
        if config == NVME:
            if label == "1 MiB":
                cases[f"{config}|{GRPC_GET}"] = get_into(clients["grpc"], config)
                cases[f"{config}|{GRPC_PUT}"] = fresh_put_case(
                    clients["grpc"], blocks, fresh, config
                )
            continue
        if config == VERIFY:
            if label == "1 MiB":
                cases[f"{config}|{SHM_GET}"] = get_into(clients["shm"], config)
                cases[f"{config}|{SHM_LEASED}"] = get_into(clients["leased"], config)
            continue
        cases[f"{config}|{SHM_GET}"] = get_into(clients["shm"], f"{config} shm")
        cases[f"{config}|{SHM_LEASED}"] = get_into(clients["leased"], f"{config} leased")
        cases[f"{config}|{SHM_PUT}"] = fresh_put_case(clients["shm"], blocks, fresh, config)
        cases[f"{config}|{GRPC_GET}"] = get_into(clients["grpc"], f"{config} gRPC")
        cases[f"{config}|{GRPC_PUT}"] = fresh_put_case(clients["grpc"], blocks, fresh, config)
    return cases


def bench_throughput(
    args: argparse.Namespace, servers: dict[str, dict[str, KVStoreClient]]
) -> dict[str, dict[str, Any]]:
    """Per size: seconds per call of every case, one list per round."""
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, Any]] = {}
    for label in args.sizes:
        began = time.monotonic()
        size = SIZES[label]
        blocks = [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in range(args.batch)]
        keys = KeySource(seed=size).take(args.batch)
        for config, clients in servers.items():
            _verify(config, clients, keys, blocks)
        cases = throughput_cases(label, blocks, keys, servers)
        rounds = [run_interleaved(cases, args.reps, warmup=2) for _ in range(args.rounds)]
        results[label] = {"block_bytes": size, "batch": args.batch, "rounds": rounds}
        for clients in servers.values():
            clients["grpc"].delete(keys)
        print(f"  {label}: {len(cases)} cases, {time.monotonic() - began:.0f} s", flush=True)
    return results


def bench_lookup(
    args: argparse.Namespace, servers: dict[str, dict[str, KVStoreClient]]
) -> list[dict[str, list[float]]]:
    """Per round: latency samples of ``lookup`` of 1024 stored keys, per config and plane."""
    keys = KeySource(seed=2).take(LOOKUP_KEYS)
    value = np.zeros(4 * KiB, dtype=np.uint8)
    cases: dict[str, Callable[[], float]] = {}
    for config in SECURITY:
        clients = servers[config]
        check(clients["shm"].put(keys, [value] * len(keys)).stored == len(keys), "lookup put")
        for plane, kind in (("shm", "shm"), ("gRPC", "grpc")):

            def lookup(client: KVStoreClient = clients[kind]) -> float:
                seconds, hits = timed(lambda: client.lookup(keys))
                check(hits == len(keys), f"lookup found {hits} of {len(keys)}")
                return seconds

            cases[f"{config}|{plane} lookup"] = lookup
    return [run_interleaved(cases, args.lookup_reps, warmup=10) for _ in range(args.rounds)]


# -- report ---------------------------------------------------------------------------------------


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _base(samples: dict[str, list[float]], base: str) -> float:
    """The median time of ``base`` in one round; for a plain case, the mean of the medians of
    both plain servers (two identical servers differ by several percent: neither alone is the
    baseline)."""
    config, _, what = base.partition("|")
    if config != PLAIN:
        return _median(samples[base])
    return (_median(samples[base]) + _median(samples[f"{PLAIN_AGAIN}|{what}"])) / 2


def _ratios(rounds: list[dict[str, list[float]]], case: str, base: str) -> list[float]:
    """Per round: throughput of ``case`` over that of ``base`` (= base time over case time)."""
    return [_base(r, base) / _median(r[case]) for r in rounds]


def _ratio_cell(values: list[float]) -> str:
    return f"{_median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def throughput_table(results: dict[str, dict[str, Any]]) -> str:
    """GB/s median (all rounds pooled), then ratios to plain and memcpy, median over rounds."""
    rows = []
    for label, result in results.items():
        call_bytes = result["block_bytes"] * result["batch"]
        rounds = result["rounds"]
        names = [name for name in rounds[0] if name != MEMCPY]
        order = {path: i for i, path in enumerate(PATHS)}
        names.sort(key=lambda n: (order[n.split("|")[1]], n.split("|")[0] not in SECURITY))
        pooled = {name: [s for r in rounds for s in r[name]] for name in rounds[0]}
        rows.append(
            [MEMCPY, "", label, f"{call_bytes / _median(pooled[MEMCPY]) / GB:.2f}", "—", "1.00"]
        )
        for name in names:
            config, path = name.split("|")
            base = f"{PLAIN}|{path}"
            vs_plain = _ratio_cell(_ratios(rounds, name, base))
            rows.append(
                [
                    path,
                    config,
                    label,
                    f"{call_bytes / _median(pooled[name]) / GB:.2f}",
                    vs_plain,
                    _ratio_cell(_ratios(rounds, name, MEMCPY)),
                ]
            )
    headers = ["path", "server", "block", "GB/s median", "vs plain (range)", "vs memcpy (range)"]
    headers[4] = "vs plain servers' mean (range)"
    return markdown_table(headers, rows, align="lllrrr")


def lookup_table(rounds: list[dict[str, list[float]]]) -> str:
    """p50 / p99 µs of lookups of 1024 keys (pooled), and p50 against plain per round."""
    rows = []
    for plane in ("shm", "gRPC"):
        for config in SECURITY:
            name = f"{config}|{plane} lookup"
            pooled = summarize([s for r in rounds for s in r[name]])
            # A latency ratio: how many times the plain p50 this p50 is.
            slower = [_median(r[name]) / _base(r, f"{PLAIN}|{plane} lookup") for r in rounds]
            rows.append(
                [
                    f"{plane} lookup",
                    config,
                    f"{pooled.median * 1e6:.0f}",
                    f"{pooled.p99 * 1e6:.0f}",
                    _ratio_cell(slower),
                    pooled.count,
                ]
            )
    headers = [
        "call (1024 keys)",
        "server",
        "p50 µs",
        "p99 µs",
        "p50 / plain servers' mean (range)",
        "calls",
    ]
    return markdown_table(headers, rows, align="llrrrr")


def verdicts(results: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 12's bound: the cost of auth and keyed integrity on shm get_into at 1 MiB."""
    if "1 MiB" not in results:
        return ["- 1 MiB was not measured: no verdict"]
    rounds = results["1 MiB"]["rounds"]
    lines = []
    for path in (SHM_GET, SHM_LEASED):
        for config in (PLAIN, PLAIN_AGAIN, TOKEN, TLS, TLS_TOKEN, MTLS, VERIFY):
            ratios = _ratios(rounds, f"{config}|{path}", f"{PLAIN}|{path}")
            cost = 1 - _median(ratios)
            if config in (PLAIN, PLAIN_AGAIN):
                verdict = "the A/A control: two identical servers"
            else:
                verdict = "10 % bound " + ("holds" if cost <= BOUND else "EXCEEDED")
                if config == VERIFY:
                    verdict += " (an option, which the bound leaves out)"
            lines.append(
                f"- {path} at 1 MiB, {config}: {_median(ratios):.2f} of the plain servers' mean "
                f"(cost {cost:+.0%}, rounds {min(ratios):.2f}-{max(ratios):.2f}); {verdict}"
            )
    return lines


def main() -> int:
    """Start every server, measure, write the report and the JSON samples next to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/auth", help="output path stem")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=8, help="blocks per call")
    parser.add_argument("--reps", type=int, default=30, help="calls per case and round")
    parser.add_argument("--lookup-reps", type=int, default=300, help="lookups per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    exit_on_sigterm()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_auth.py", *sys.argv[1:]])
    started_at = datetime.datetime.now(datetime.UTC)
    info = machine_info(["kvstore", "grpcio", "numpy"], {"openssl": ["openssl", "version"]})
    clock = time.monotonic()
    token = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="bench-auth-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        pki = make_pki(workdir)
        servers = {}
        for config in configs(workdir, pki, token):
            servers[config.name] = started(stack, config)
        print("throughput ...", flush=True)
        throughput = bench_throughput(args, servers)
        print("lookup ...", flush=True)
        lookups = bench_lookup(args, servers)
        for config, clients in servers.items():
            stats = clients["grpc"].stats()["tiers"]
            dram = stats.get("dram", {})
            check(dram.get("evictions", 0) == 0, f"{config}: the server evicted blocks")
            check(dram.get("corrupt_blocks", 0) == 0, f"{config}: a block failed verification")
    elapsed = time.monotonic() - clock
    info["load average after (1/5/15 min)"] = machine_info()["load average (1/5/15 min)"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = "\n\n".join(
        [
            "# What TLS, tokens and keyed integrity cost the data plane and lookups",
            f"Command: `{command}`  \nStarted {started_at:%Y-%m-%d %H:%M} UTC, took "
            f"{elapsed:.0f} s; {args.rounds} rounds, batch {args.batch}, {args.reps} calls per "
            "case and round.",
            "## Issue 12's bound (shm get_into at 1 MiB, at most 10 % slower)\n\n"
            + "\n".join(verdicts(throughput)),
            "## Throughput, one client\n\n" + throughput_table(throughput),
            "## Lookup latency\n\n" + lookup_table(lookups),
            "## Machine\n\n" + "\n".join(f"- {k}: {v}" for k, v in info.items()),
        ]
    )
    out.with_suffix(".md").write_text(report + "\n")
    samples = {"throughput": throughput, "lookup": lookups, "machine": info, "command": command}
    out.with_suffix(".json").write_text(json.dumps(samples, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
