"""The ``--target`` of the client commands (``stats``, ``demo``): checked like ``--listen``,
with the server's default port filled in, and the one line to say when nothing answers there.

gRPC reads a target without a port as port 443 (HTTPS's), so ``--target localhost`` would dial
a port no ``kvstore serve`` uses; here it means ``localhost:50051``.
"""

from __future__ import annotations

import argparse
import re

from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError

__all__ = ["DEFAULT_PORT", "DEFAULT_TARGET", "nothing_answers", "parse_target"]

#: Where ``kvstore serve`` listens by default (``server.listen``), and its port.
DEFAULT_TARGET: str = ServerConfig.listen
DEFAULT_PORT = int(DEFAULT_TARGET.rpartition(":")[2])

_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+")


def parse_target(text: str) -> str:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) with a port from 1 to 65535, or ``HOST`` alone
    for port :data:`DEFAULT_PORT`; an ``argparse`` type, so a bad one is a usage error."""
    value = text.strip()
    if "://" in value:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a URL; give HOST:PORT (e.g. {DEFAULT_TARGET}), no scheme"
        )
    if _HOST.fullmatch(value):
        return f"{value}:{DEFAULT_PORT}"
    host, sep, port = value.rpartition(":")
    numeric = re.fullmatch(r"[0-9]{1,5}", port) is not None
    if sep and _HOST.fullmatch(host) and numeric and 1 <= int(port) <= 65535:
        return f"{host}:{int(port)}"
    raise argparse.ArgumentTypeError(
        f"must be HOST:PORT with a port from 1 to 65535, or HOST for port {DEFAULT_PORT} "
        f"(e.g. {DEFAULT_TARGET}), got {text!r}"
    )


def nothing_answers(target: str, exc: KVStoreError) -> str:
    """The line for a server that cannot be reached, with gRPC's reason after it."""
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"nothing answers at {target} — is `kvstore serve` running? ({detail})"
