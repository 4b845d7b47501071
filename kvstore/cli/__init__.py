"""The ``kvstore`` command: ``serve``, ``stats``, ``demo`` and ``router``.

::

    kvstore --version
    kvstore serve [--config FILE] [--log-level LEVEL] [SETTING FLAGS ...]
    kvstore stats [--target HOST:PORT] [--json | --watch [SECONDS]] [--token TOKEN] [--tls-ca FILE]
    kvstore demo  [--target HOST:PORT] [--wait SECONDS] [--token TOKEN] [--tls-ca FILE]
    kvstore router [--config FILE] [--log-level LEVEL] [--index-url URL] [SETTING FLAGS ...]

``--token`` and ``--tls-ca`` default to ``$KVSTORE_TOKEN`` and ``$KVSTORE_TLS_CA``. The setting
flags of ``serve`` and ``router`` come from the settings' metadata (:mod:`kvstore.cli.flags`),
grouped by config section in ``--help``.

Flags override ``KVSTORE_*`` environment variables, which override the config file; see
:mod:`kvstore.config` for every setting. Errors are one line on stderr (exit 2), never a
traceback; an unknown ``KVSTORE_*`` variable is warned about, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import logging
import os
import platform
import sys
import time
import tomllib
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.cli.flags import add_setting_flags, flag_overrides
from kvstore.cli.router import add_router_parser, run_router_command
from kvstore.cli.stats import format_stats, watch
from kvstore.cli.targets import DEFAULT_PORT, DEFAULT_TARGET, nothing_answers, parse_target
from kvstore.client import KVStoreClient
from kvstore.client.channel import ChannelSecurity, blocking_channel
from kvstore.client.settings import ClientSettings
from kvstore.config import SIZE_HINT, Config, env_var, load_config, unknown_env_vars
from kvstore.errors import ConfigError, KVStoreError, StoreUnavailableError
from kvstore.keys import ChunkHasher, Namespace

__all__ = ["SERVE_SECTIONS", "main", "version_line", "wait_until_serving"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Exit status of a process whose reader went away (128 + SIGPIPE), as shell tools end.
EXIT_BROKEN_PIPE = 141

#: The config sections whose settings' flags ``kvstore serve`` takes (``router.*`` are
#: ``kvstore router``'s).
SERVE_SECTIONS = (
    "server",
    "shm",
    "ucx",
    "auth",
    "hbm",
    "dram",
    "nvme",
    "redis",
    "integrity",
    "policy",
    "cluster",
    "keys",
)


def version_line() -> str:
    """``kvstore VERSION (package at PATH, Python X.Y.Z)``: which install answers ``kvstore``."""
    import kvstore

    where = os.path.dirname(kvstore.__file__)
    return f"kvstore {kvstore.__version__} (package at {where}, Python {platform.python_version()})"


def _builtin_defaults() -> Config | None:
    """The defaults of this machine, before any file, variable or flag (for help)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    try:
        return load_config(None, env=env)
    except ConfigError:
        return None


class _Parser(argparse.ArgumentParser):
    """argparse that suggests the closest known flag for a misspelt one."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            options = [o for o in self._option_string_actions if o.startswith("--")]
            for word in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(word.split("=")[0], options, n=1)
                if word.startswith("-") and close:
                    message += f" (did you mean {close[0]}?)"
                    break
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    """The ``kvstore`` argument parser."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``kvstore`` parser and, by command, the parser of each command."""
    defaults = _builtin_defaults()
    parser = _Parser(
        prog="kvstore",
        description="Tiered KV-cache store service for LLM inference engines.",
        epilog="Run 'kvstore COMMAND --help' for a command's flags and their defaults.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    serve = commands.add_parser(
        "serve",
        help="run the store server",
        description="Run the store server. Every flag also has a KVSTORE_* environment variable "
        "and a config file key (flags win over variables, variables over the file); defaults "
        f"are this machine's. {SIZE_HINT[0].upper()}{SIZE_HINT[1:]}.",
    )
    serve.add_argument(
        "--config", metavar="FILE", help="TOML config file (also KVSTORE_CONFIG; default: none)"
    )
    serve.add_argument(
        "--log-level",
        metavar="LEVEL",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help=f"one of {', '.join(LOG_LEVELS)} (default: INFO)",
    )
    serve.set_defaults(setting_flags=add_setting_flags(serve, SERVE_SECTIONS, defaults))

    stats = commands.add_parser(
        "stats",
        help="print tier usage and counters of a server",
        description="Print tier "
        "usage and counters of a server, once or every few seconds (--watch).",
    )
    stats.add_argument(
        "--target",
        metavar="HOST:PORT",
        type=parse_target,
        default=DEFAULT_TARGET,
        help=f"server; a HOST alone means port {DEFAULT_PORT} (default: %(default)s)",
    )
    output = stats.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON instead of a table")
    output.add_argument(
        "--watch",
        metavar="SECONDS",
        nargs="?",
        type=float,
        const=2.0,
        help="refresh every SECONDS (2 if not given) with counter rates, until Ctrl-C",
    )
    stats.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=5.0,
        help="deadline of each call (default: %(default)s)",
    )
    _client_flags(stats)

    demo = commands.add_parser(
        "demo",
        help="store a few blocks and read them back",
        description="Store a few blocks in a running server and read them back bit-identical.",
    )
    demo.add_argument(
        "--target",
        metavar="HOST:PORT",
        type=parse_target,
        default=DEFAULT_TARGET,
        help=f"server; a HOST alone means port {DEFAULT_PORT} (default: %(default)s)",
    )
    demo.add_argument(
        "--wait",
        metavar="SECONDS",
        type=float,
        default=0.0,
        help="seconds to wait for the server to answer (default: %(default)s)",
    )
    _client_flags(demo)
    router = add_router_parser(commands, defaults)
    return parser, {"serve": serve, "stats": stats, "demo": demo, "router": router}


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token", metavar="TOKEN", help="bearer token (default: $KVSTORE_TOKEN)")
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="PEM CA of the server: connect over TLS (default: $KVSTORE_TLS_CA)",
    )


def _client(args: argparse.Namespace, **kwargs: Any) -> KVStoreClient:
    return KVStoreClient(args.target, token=args.token, tls_ca=args.tls_ca, **kwargs)


def _serve(args: argparse.Namespace) -> int:
    from kvstore.cli.checks import free_metrics_port, preflight
    from kvstore.server.app import run_server

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = load_config(args.config, overrides=flag_overrides(args, args.setting_flags))
    if not _metrics_listen_set(args):
        config = free_metrics_port(config)
    # Before anything opens (the arena, LMDB, the port): a misconfiguration leaves nothing behind.
    preflight(config)

    def ready(address: str) -> None:
        print(f"kvstore serving on {address}", flush=True)

    def metrics(url: str) -> None:
        print(f"kvstore metrics on {url}", flush=True)

    asyncio.run(run_server(config, on_ready=ready, on_metrics=metrics))
    return 0


def _metrics_listen_set(args: argparse.Namespace) -> bool:
    """Whether ``server.metrics_listen`` was set (flag, variable or config file): a set one is
    used as given, the default one gives way to a free port when another server holds it."""
    if args.metrics_listen is not None or env_var("server.metrics_listen") in os.environ:
        return True
    path = args.config or os.environ.get("KVSTORE_CONFIG")
    if not path:
        return False
    try:
        with open(path, "rb") as handle:
            server = tomllib.load(handle).get("server", {})
    except (OSError, tomllib.TOMLDecodeError):
        return True  # load_config read it a moment ago; if not now, keep the strict check
    return isinstance(server, dict) and "metrics_listen" in server


def _stats(args: argparse.Namespace) -> int:
    with _client(args, timeout=args.timeout) as client:
        if args.watch is not None:
            if not args.watch > 0:
                raise ConfigError(f"--watch SECONDS must be > 0, got {args.watch:g}")
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
                watch(client.stats, args.watch, args.target)
            return 0
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        print("\n".join(format_stats(stats)))
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


def _run(argv: Sequence[str] | None) -> int:
    parser, commands = _parsers()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        # A bare ``kvstore``: the commands, not argparse's one terse line.
        parser.print_help(sys.stderr)
        return 2
    if extra:
        # Reported by the command's parser, which knows (and suggests) its own flags.
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    for warning in unknown_env_vars(os.environ):
        print(f"kvstore: warning: {warning}", file=sys.stderr)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "stats":
            return _stats(args)
        if args.command == "router":
            return run_router_command(args)
        return _demo(args)
    except BrokenPipeError:
        raise  # not an error of the command: main ends quietly
    except StoreUnavailableError as exc:
        print(f"kvstore {args.command}: {nothing_answers(args.target, exc)}", file=sys.stderr)
        return 2
    except (KVStoreError, TimeoutError, OSError) as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except BrokenPipeError:
        # The reader went away (``kvstore stats | head -1``): end quietly, as shell tools do.
        # Point stdout at /dev/null so the interpreter's own flush at exit fails no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
