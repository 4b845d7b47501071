"""The ``kvstore`` command: ``serve``, ``stats`` and ``demo``.

::

    kvstore serve [--config FILE] [--listen HOST:PORT] [--dram-capacity SIZE] [--nvme-path DIR]
                  [--nvme-capacity SIZE] [--max-block-bytes SIZE] [--redis-url URL]
                  [--redis-ttl SECONDS] [--shm-socket PATH] [--shm-socket-mode MODE]
                  [--ucx-listen HOST:PORT] [--tls-cert FILE --tls-key FILE]
                  [--tls-client-ca FILE] [--tokens-file FILE] [--allow-unauthenticated]
                  [--log-level LEVEL]
    kvstore stats [--target HOST:PORT] [--json] [--token TOKEN] [--tls-ca FILE]
    kvstore demo  [--target HOST:PORT] [--wait SECONDS] [--token TOKEN] [--tls-ca FILE]

``--token`` and ``--tls-ca`` default to ``$KVSTORE_TOKEN`` and ``$KVSTORE_TLS_CA``.

Flags override ``KVSTORE_*`` environment variables, which override the config file; see
:mod:`kvstore.config` for every setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.client.channel import ChannelSecurity, blocking_channel
from kvstore.client.settings import ClientSettings
from kvstore.config import format_size, load_config
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkHasher, Namespace

__all__ = ["main"]

DEFAULT_TARGET = "127.0.0.1:50051"

# flag name -> dotted setting name
_SERVE_FLAGS = {
    "listen": "server.listen",
    "dram_capacity": "dram.capacity",
    "dram_page_size": "dram.page_size",
    "nvme_path": "nvme.path",
    "nvme_capacity": "nvme.capacity",
    "max_block_bytes": "server.max_block_bytes",
    "redis_url": "redis.url",
    "redis_ttl": "redis.ttl_s",
    "shm_socket": "server.shm_socket",
    "shm_socket_mode": "server.shm_socket_mode",
    "ucx_listen": "server.ucx_listen",
    "tls_cert": "server.tls_cert",
    "tls_key": "server.tls_key",
    "tls_client_ca": "server.tls_client_ca",
    "tokens_file": "server.tokens_file",
    "allow_unauthenticated": "server.allow_unauthenticated",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache store service.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the store server")
    serve.add_argument("--config", help="TOML config file (also KVSTORE_CONFIG)")
    serve.add_argument("--listen", help="HOST:PORT to serve gRPC on (default 127.0.0.1:50051)")
    serve.add_argument("--dram-capacity", help="host arena size, e.g. 4GiB (0 disables)")
    serve.add_argument("--dram-page-size", help="arena page size, e.g. 64KiB")
    serve.add_argument("--nvme-path", help="LMDB directory ('' disables the tier)")
    serve.add_argument("--nvme-capacity", help="LMDB size limit, e.g. 100GiB")
    serve.add_argument("--max-block-bytes", help="largest accepted block, e.g. 64MiB")
    serve.add_argument(
        "--redis-url", help="shared redis tier, redis://HOST:PORT/DB or redis+cluster://HOST:PORT"
    )
    serve.add_argument("--redis-ttl", help="seconds a block lives in redis (default 3600)")
    serve.add_argument(
        "--shm-socket",
        help="UNIX socket of the shared-memory data plane ('auto' default, '' turns it off)",
    )
    serve.add_argument(
        "--shm-socket-mode",
        help="octal permission bits of that socket (default 0660: the server's user and group)",
    )
    serve.add_argument(
        "--ucx-listen", help="HOST:PORT of the UCX listener for remote clients (off by default)"
    )
    serve.add_argument("--tls-cert", help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", help="PEM CA: require client certificates signed by it (mTLS)"
    )
    serve.add_argument(
        "--tokens-file", help="file of 'NAME SHA256HEX' lines: bearer tokens, stored hashed"
    )
    serve.add_argument(
        "--allow-unauthenticated",
        action="store_const",
        const=True,
        default=None,
        help="listen beyond loopback with neither tokens nor client certificates",
    )
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")

    stats = commands.add_parser("stats", help="print tier usage and counters of a server")
    stats.add_argument("--target", default=DEFAULT_TARGET, help="server HOST:PORT")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.add_argument("--timeout", type=float, default=5.0, help="deadline in seconds")
    _client_flags(stats)

    demo = commands.add_parser("demo", help="store a few blocks and read them back")
    demo.add_argument("--target", default=DEFAULT_TARGET, help="server HOST:PORT")
    demo.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the server")
    _client_flags(demo)
    return parser


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token", help="bearer token (default $KVSTORE_TOKEN)")
    parser.add_argument("--tls-ca", help="PEM CA of the server: connect over TLS ($KVSTORE_TLS_CA)")


def _client(args: argparse.Namespace, **kwargs: Any) -> KVStoreClient:
    return KVStoreClient(args.target, token=args.token, tls_ca=args.tls_ca, **kwargs)


def _serve(args: argparse.Namespace) -> int:
    from kvstore.server.app import run_server

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {setting: getattr(args, flag) for flag, setting in _SERVE_FLAGS.items()}
    config = load_config(args.config, overrides=overrides)

    def ready(address: str) -> None:
        print(f"kvstore serving on {address}", flush=True)

    asyncio.run(run_server(config, on_ready=ready))
    return 0


def _print_stats(stats: dict[str, Any]) -> None:
    print(f"{'tier':<8}{'used':>14}{'capacity':>14}{'blocks':>10}{'hits':>10}{'evictions':>11}")
    for name, tier in stats["tiers"].items():
        print(
            f"{name:<8}{format_size(tier.get('used', 0)):>14}"
            f"{format_size(tier.get('capacity', 0)):>14}{tier.get('blocks', 0):>10}"
            f"{tier.get('hits', 0):>10}{tier.get('evictions', 0):>11}"
        )
    counters = stats["counters"]
    print(
        f"blocks {stats['blocks']}  hits {counters.get('hits', 0)}  misses "
        f"{counters.get('misses', 0)}  evicted {counters.get('evicted_from_store', 0)}"
    )
    for name, tier in stats["tiers"].items():
        extra = {k: v for k, v in tier.items() if k not in {"used", "capacity", "blocks", "hits"}}
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))


def _stats(args: argparse.Namespace) -> int:
    with _client(args, timeout=args.timeout) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        _print_stats(stats)
    return 0


def wait_until_serving(target: str, timeout: float, tls_ca: str | None = None) -> None:
    """Poll the standard health service until the server answers SERVING or ``timeout`` passes
    (over TLS when ``tls_ca`` names the server's CA; health needs no token)."""
    deadline = time.monotonic() + timeout
    security = ChannelSecurity.build(None, tls_ca or ClientSettings.from_env().tls_ca or None)
    with blocking_channel(target, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no kvstore serving on {target} after {timeout:.0f}s")
            time.sleep(0.2)


def _demo(args: argparse.Namespace) -> int:
    import numpy as np

    if args.wait:
        wait_until_serving(args.target, args.wait, args.tls_ca)
    namespace = Namespace(model="demo-model", num_layers=2, num_kv_heads=2, head_size=64)
    hasher = ChunkHasher(chunk_size=16, namespace=namespace)
    tokens = list(range(64))
    keys = hasher.keys(tokens)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size=256 * 1024, dtype=np.uint8) for _ in keys]
    with _client(args, namespace=namespace) as client:
        result = client.put(keys, blocks)
        print(
            f"put {len(keys)} blocks of 256 KiB: stored={result.stored} "
            f"already_present={result.already_present}"
        )
        lookup = client.lookup_tiers(keys)
        print(f"lookup: {lookup.hits} leading chunks present, tiers={lookup.tiers}")
        values = client.get(keys)
        for key, block, value in zip(keys, blocks, values, strict=True):
            same = value is not None and value == block.tobytes()
            print(f"  {key.hex()}  {len(value or b'')} bytes  identical={same}")
        other = hasher.keys(list(range(1000, 1064)))
        print(f"lookup of an unseen prompt: {client.lookup(other)} chunks present")
        ok = all(v is not None and v == b.tobytes() for v, b in zip(values, blocks, strict=True))
    print("demo OK: every block read back bit-identical" if ok else "demo FAILED")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "stats":
            return _stats(args)
        return _demo(args)
    except (KVStoreError, TimeoutError, OSError) as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
