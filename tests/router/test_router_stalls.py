"""A client that stalls cannot hold the router: 408 while its request is read, dropped while its
response is relayed (:data:`kvstore.router.proxy.CLIENT_STALL_S`, shortened here). Real loopback
sockets; the router's own read and relay functions."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from kvstore.router import proxy
from kvstore.router.proxy import BadRequest, ClientGone, read_request, respond

STALL_S = 0.5
#: Generous: a loaded 2-core runner may be slow to schedule, but never this slow.
DEADLINE_S = 20.0

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def answer_bad_requests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """What the router's handler does with a request it cannot read."""
    try:
        await read_request(reader, writer, max_body=1 << 20)
    except BadRequest as exc:
        await respond(writer, exc.status, {"error": str(exc)})
    finally:
        writer.close()


async def reply_of(port: int, sent: bytes) -> bytes:
    """Send ``sent``, then nothing more; everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(sent)
    await writer.drain()
    async with asyncio.timeout(DEADLINE_S):
        reply = await reader.read()
    writer.close()
    return reply


@pytest.fixture(autouse=True)
def short_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "CLIENT_STALL_S", STALL_S)


@pytest.mark.parametrize(
    ("sent", "named"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"no complete request head within 0.5s"),
        (
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b"x" * 10,
            b"the body stalled for 0.5s after 10 of 100 bytes",
        ),
    ],
    ids=["head", "body"],
)
def test_a_stalled_request_is_answered_408(sent: bytes, named: bytes) -> None:
    async def run() -> tuple[bytes, float]:
        server, port = await serve(answer_bad_requests)
        async with server:
            started = time.monotonic()
            reply = await reply_of(port, sent)
            return reply, time.monotonic() - started

    reply, took = asyncio.run(run())
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert named in reply
    assert STALL_S <= took < DEADLINE_S


def test_a_request_that_keeps_coming_is_not_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is per stall, not per request: a body that takes longer than one stall bound in
    all, but never stalls that long, is read whole."""
    # Longer here, so that a loaded runner's scheduling gaps never look like a stall.
    monkeypatch.setattr(proxy, "CLIENT_STALL_S", 2.0)

    async def run() -> bytes:
        got: list[bytes] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await read_request(reader, writer, max_body=1 << 20)
            assert request is not None
            got.append(bytes(request.body))
            await respond(writer, 200, {"ok": True})
            writer.close()

        server, port = await serve(handler)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nContent-Length: 8\r\n\r\n")
            for piece in (b"ab", b"cd", b"ef", b"gh"):  # 4 pieces over 2.4 s: more than 2.0
                await asyncio.sleep(0.6)
                writer.write(piece)
                await writer.drain()
            async with asyncio.timeout(DEADLINE_S):
                await reader.read()
            writer.close()
        return got[0]

    assert asyncio.run(run()) == b"abcdefgh"


def test_a_client_that_reads_nothing_is_dropped() -> None:
    """The relay gives up after one stall instead of buffering the response for it."""

    async def run() -> tuple[BaseException | None, float]:
        outcome: list[BaseException | None] = []
        started: list[float] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.set_write_buffer_limits(high=1 << 16)
            started.append(time.monotonic())
            try:
                for _ in range(4096):  # 256 MiB: far beyond what socket buffers take
                    await proxy._relay(writer, b"x" * (1 << 16))
                outcome.append(None)
            except ClientGone as exc:
                outcome.append(exc)

        server, port = await serve(handler)
        async with server:
            client = socket.create_connection(("127.0.0.1", port))
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            async with asyncio.timeout(DEADLINE_S):
                while not outcome:
                    await asyncio.sleep(0.05)
            client.close()
        return outcome[0], time.monotonic() - started[0]

    error, took = asyncio.run(run())
    assert isinstance(error, ClientGone)
    assert "took nothing for 0.5s" in str(error)
    assert took < DEADLINE_S
