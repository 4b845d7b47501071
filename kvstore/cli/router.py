"""``kvstore router``: its flags and how it starts (see :mod:`kvstore.router`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from kvstore.config import load_config

__all__ = ["add_router_parser", "run_router_command"]

#: flag name -> dotted setting name
ROUTER_FLAGS = {
    "listen": "router.listen",
    "namespace": "router.namespace",
    "chunk_size": "router.chunk_size",
    "tokenizer": "router.tokenizer",
    "tenant": "router.tenant",
    "index_url": "cluster.url",
    "policy": "router.policy",
    "max_body_bytes": "router.max_body_bytes",
}


def add_router_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``router`` to the ``kvstore`` subcommands."""
    router: argparse.ArgumentParser = commands.add_parser(
        "router",
        help="route OpenAI requests to the vLLM replica that holds their prefix",
        description="An OpenAI-compatible proxy in front of vLLM replicas that sends each "
        "request where its prompt's KV cache already is (the cluster index of cluster.url, else "
        "redis.url), weighed against load. Every flag also has a KVSTORE_ROUTER_* variable and "
        "a [router] config key.",
    )
    router.add_argument("--config", metavar="FILE", help="TOML config file (also KVSTORE_CONFIG)")
    router.add_argument(
        "--listen", metavar="HOST:PORT", help="HTTP address (default 127.0.0.1:8000)"
    )
    router.add_argument(
        "--replica",
        metavar="URL=NODE_ID",
        action="append",
        help="a vLLM server and the kvstore node beside it; repeat per replica (router.replicas)",
    )
    for role, engine in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        router.add_argument(
            f"--{role}",
            metavar="URL=NODE_ID",
            action="append",
            help=f"P/D mode, instead of --replica: a {role} replica (its connector's kv_role "
            f"{engine}) and the kvstore node beside it; repeat per replica (router.{role})",
        )
    router.add_argument(
        "--namespace",
        metavar="JSON",
        help="deprecated (the router reads the key scheme its nodes publish): the engines' base "
        "namespace as JSON, used only while no node publishes one (router.namespace)",
    )
    router.add_argument(
        "--chunk-size",
        metavar="TOKENS",
        type=int,
        help="deprecated, as --namespace (router.chunk_size)",
    )
    router.add_argument(
        "--tokenizer", metavar="PATH", help="Hugging Face tokenizer files of the model (optional)"
    )
    router.add_argument("--tenant", metavar="NAME", help="the kvstore tenant the engines use")
    router.add_argument(
        "--policy",
        choices=("kv", "round_robin", "least_loaded"),
        help="kv (default): where the prefix is cached, weighed against load; round_robin and "
        "least_loaded ignore the cache (baselines) (router.policy)",
    )
    router.add_argument(
        "--index-url", metavar="URL", help="the cluster index's Redis (cluster.url)"
    )
    router.add_argument(
        "--max-body-bytes",
        metavar="SIZE",
        help="the largest request body read, e.g. 64MiB (default 16MiB, at most 1GiB); a larger "
        "one is answered 413 (router.max_body_bytes)",
    )
    router.add_argument(
        "--log-level",
        metavar="LEVEL",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="default: INFO",
    )
    return router


def run_router_command(args: argparse.Namespace) -> int:
    """Run ``kvstore router`` until interrupted."""
    from kvstore.router import run_router

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides: dict[str, Any] = {s: getattr(args, f) for f, s in ROUTER_FLAGS.items()}
    if args.replica:
        overrides["router.replicas"] = ",".join(args.replica)
    for role in ("prefill", "decode"):
        if getattr(args, role):
            overrides[f"router.{role}"] = ",".join(getattr(args, role))
    config = load_config(args.config, overrides=overrides)

    def ready(url: str) -> None:
        print(f"kvstore router on {url}", flush=True)

    asyncio.run(run_router(config, ready))
    return 0
