"""``kvstore router``: its flags and how it starts (see :mod:`kvstore.router`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from kvstore.cli.flags import add_setting_flags, flag_overrides
from kvstore.config import Config, load_config

__all__ = ["add_router_parser", "run_router_command"]

#: The one flag of ``kvstore router`` for a setting outside ``[router]``: where the index is.
_INDEX_URL_SETTING = "cluster.url"


def add_router_parser(commands: Any, defaults: Config | None) -> argparse.ArgumentParser:
    """Add ``router`` to the ``kvstore`` subcommands (``defaults``: the built-in config, for the
    defaults its help shows)."""
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
        "--index-url", metavar="URL", help="the cluster index's Redis (cluster.url)"
    )
    router.add_argument(
        "--log-level",
        metavar="LEVEL",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="default: INFO",
    )
    router.set_defaults(setting_flags=add_setting_flags(router, ("router",), defaults))
    return router


def run_router_command(args: argparse.Namespace) -> int:
    """Run ``kvstore router`` until interrupted."""
    from kvstore.router import run_router

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = flag_overrides(args, args.setting_flags)
    overrides[_INDEX_URL_SETTING] = args.index_url
    config = load_config(args.config, overrides=overrides)

    def ready(url: str) -> None:
        print(f"kvstore router on {url}", flush=True)

    asyncio.run(run_router(config, ready))
    return 0
