"""A minimal HTTP/1.1 server and streaming pass-through on asyncio streams.

The router's needs are narrow: read a request with a ``Content-Length`` body (at most
``router.max_body_bytes``, checked before a byte of it is read), send it to one upstream, and
copy the upstream's response back byte for byte as it arrives (server-sent events of a
streaming completion included, chunked framing untouched). Both connections are
``Connection: close``: the end of the upstream's bytes is the end of the response, so no
framing is parsed or rewritten. (The shared environment has no aiohttp; this needs nothing.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "REPLICA_HEADER",
    "ClientGone",
    "Request",
    "UpstreamError",
    "forward",
    "read_request",
    "respond",
    "send_upstream",
]

#: Response header naming the replica URL that answered a proxied request.
REPLICA_HEADER = "x-kvstore-replica"
#: The longest the router waits on a client at any one point: for its request head, for each
#: piece of its body, for it to take each piece of its response. A client stalled longer is
#: answered 408 (while its request is read) or dropped (while its response is relayed), so a
#: connection that sends or reads nothing cannot hold a handler, a buffer or an upstream forever.
CLIENT_STALL_S = 30.0
#: How much of a body one read takes (and at most what one write to an upstream queues).
_PIECE = 1 << 20
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "host",
        "content-length",
        "transfer-encoding",
        "proxy-connection",
        "te",
        "upgrade",
        "expect",  # the router answers 100-continue itself
    }
)
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    411: "Length Required",
    413: "Payload Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


@dataclass
class Request:
    """One parsed HTTP request."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes | bytearray

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive)."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


class BadRequest(Exception):
    """The client sent something this server does not take; ``status`` says how to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UpstreamError(Exception):
    """The upstream could not be reached or closed before answering (nothing was sent back)."""


class ClientGone(ConnectionError):
    """The client's connection failed while its response was being relayed."""


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_body: int
) -> Request | None:
    """The next request, ``None`` if the client closed; raises :class:`BadRequest`.

    A body over ``max_body`` bytes (``router.max_body_bytes``) is refused from its
    ``Content-Length`` alone; a client that sent ``Expect: 100-continue`` gets the go-ahead only
    for a body within it. A client that stalls :data:`CLIENT_STALL_S` in its head or between
    pieces of its body gets a 408.
    """
    try:
        async with asyncio.timeout(CLIENT_STALL_S):
            head = await reader.readuntil(b"\r\n\r\n")
    except TimeoutError as exc:
        raise BadRequest(408, f"no complete request head within {CLIENT_STALL_S:g}s") from exc
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError as exc:
        raise BadRequest(400, "request head too large") from exc
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise BadRequest(400, "malformed request line")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(400, "malformed header")
        headers.append((name.strip(), value.strip()))
    request = Request(parts[0], parts[1], headers, b"")
    if request.header("transfer-encoding"):
        raise BadRequest(411, "send the body with a Content-Length (chunked bodies are not read)")
    length_text = request.header("content-length") or "0"
    if not length_text.isdigit():
        raise BadRequest(400, f"Content-Length {length_text[:40]!r} is not a number of bytes")
    length = int(length_text)
    if length > max_body:
        raise BadRequest(
            413,
            f"the body is {length} bytes; router.max_body_bytes allows at most {max_body} "
            "(a size up to 1GiB)",
        )
    if length and (request.header("expect") or "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.body = await _read_body(reader, length)
    return request


async def _read_body(reader: asyncio.StreamReader, length: int) -> bytearray:
    """``length`` bytes into one buffer, a piece at a time (``readexactly`` would hold them
    twice: its buffer grown to the whole body, then a copy)."""
    body = bytearray(length)
    with memoryview(body) as view:
        got = 0
        while got < length:
            try:
                async with asyncio.timeout(CLIENT_STALL_S):
                    piece = await reader.read(min(length - got, _PIECE))
            except TimeoutError as exc:
                raise BadRequest(
                    408, f"the body stalled for {CLIENT_STALL_S:g}s after {got} of {length} bytes"
                ) from exc
            if not piece:
                raise asyncio.IncompleteReadError(b"", length)
            view[got : got + len(piece)] = piece
            got += len(piece)
    return body


async def respond(
    writer: asyncio.StreamWriter, status: int, payload: Any, content_type: str = "application/json"
) -> None:
    """Answer with ``payload`` (JSON-encoded unless bytes) and close."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    await _relay(writer, head.encode() + body)


async def send_upstream(
    url: str,
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]],
    body: bytes | bytearray,
    connect_timeout_s: float | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, list[str]]:
    """Send one request (``Connection: close``) to the server at ``url``; read its response head.

    The client's own headers (say, ``Authorization``) go along, hop-by-hop ones excepted. Returns
    the connection, for the caller to read the body from and close, and the head's lines (status
    line first). Raises :class:`UpstreamError` if the server cannot be reached (within
    ``connect_timeout_s``; None: no bound of its own) or closes before answering.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 20), connect_timeout_s
        )
    except (OSError, TimeoutError) as exc:
        raise UpstreamError(f"cannot reach {url}: {exc}") from exc
    try:
        lines = [f"{method} {parts.path.rstrip('/')}{target} HTTP/1.1", f"Host: {host}:{port}"]
        lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP]
        lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer.write("\r\n".join(lines).encode("latin-1"))
        view = memoryview(body)  # a piece at a time: the transport copies what it queues
        for start in range(0, len(body), _PIECE):
            writer.write(view[start : start + _PIECE])
            await writer.drain()
        await writer.drain()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            raise UpstreamError(f"{url} closed without answering: {exc}") from exc
    except BaseException:
        writer.close()
        raise
    return reader, writer, head[:-4].decode("latin-1").split("\r\n")


async def forward(
    url: str,
    request: Request,
    writer: asyncio.StreamWriter,
    on_first_byte: Callable[[], None],
    connect_timeout_s: float = 5.0,
) -> None:
    """Send ``request`` to the server at ``url`` and stream its response to ``writer``.

    Raises :class:`UpstreamError` if nothing was sent back yet (the caller may try another
    upstream); once the response head went to the client, errors end the response early.
    """
    reader, upstream, head_lines = await send_upstream(
        url, request.method, request.target, request.headers, request.body, connect_timeout_s
    )
    try:
        # The client's connection closes after this response too: say so, whatever upstream said.
        kept = [head_lines[0]] + [
            line
            for line in head_lines[1:]
            if line.partition(":")[0].strip().lower() not in ("connection", "keep-alive")
        ]
        # Which replica answered, for clients and tests (the decision metrics count the same).
        kept.append(f"{REPLICA_HEADER}: {url}")
        await _relay(writer, ("\r\n".join([*kept, "Connection: close", "", ""])).encode("latin-1"))
        first = True
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            if first:
                on_first_byte()
                first = False
            await _relay(writer, data)
        if first:
            on_first_byte()
    finally:
        upstream.close()


async def _relay(writer: asyncio.StreamWriter, data: bytes) -> None:
    """``data`` to the client; :class:`ClientGone` if its connection failed or it took nothing
    for :data:`CLIENT_STALL_S`."""
    try:
        writer.write(data)
        async with asyncio.timeout(CLIENT_STALL_S):
            await writer.drain()
    except TimeoutError as exc:
        writer.transport.abort()  # what it did not take is dropped, not buffered on
        raise ClientGone(f"the client took nothing for {CLIENT_STALL_S:g}s") from exc
    except (ConnectionError, OSError) as exc:
        raise ClientGone(f"the client went away: {exc}") from exc
