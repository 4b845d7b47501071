"""The gRPC channels of a client: plain or TLS (optionally with a client certificate), and a
bearer token sent on every call.

The token rides as ``authorization: Bearer <token>`` metadata added by a channel interceptor, so
every call on the channel carries it: data calls, the ``DataPlane`` discovery call and the UCX
control calls alike. It is sent over a plain channel too (a loopback server with tokens but no
TLS); across a network, use TLS (``tls_ca``) so the token is not readable on the wire.

Every channel retries a lost connection at most :data:`RECONNECT_BACKOFF_MAX_MS` apart. gRPC's
own default backoff grows to two minutes: a client whose server was down 30 s then failed for
another 10 s after the server came back, every call refused by a channel still waiting out its
backoff. A refused connection attempt costs one TCP handshake, so a short ceiling is cheap.
:func:`when_reconnected` tells a caller that stopped calling (a circuit breaker) the moment the
server answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.client.settings import ClientSettings
from kvstore.errors import ConfigError
from kvstore.protocol import messages as _wire

__all__ = [
    "RECONNECT_BACKOFF_MAX_MS",
    "RECONNECT_OPTIONS",
    "ChannelSecurity",
    "ReconnectWatch",
    "aio_channel",
    "blocking_channel",
    "settle_watches",
    "when_reconnected",
]

#: The longest wait between two connection attempts of a channel whose server is gone.
RECONNECT_BACKOFF_MAX_MS = 500

#: Channel arguments every client channel gets. The connect timeout
#: (``grpc.min_reconnect_backoff_ms``) keeps its default of 20 s: lowering it would fail a
#: handshake slower than the backoff (TLS over a long link) for ever.
RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
]

logger = logging.getLogger(__name__)

Pem = str | bytes | Path | None


def _pem(what: str, value: Pem) -> bytes | None:
    """PEM bytes from bytes, or from a file path; ``None`` stays ``None``."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {value} ({exc})") from exc


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches its server: ``token`` (bearer), ``tls_ca`` (PEM path or bytes of the
    CA that signed the server's certificate; given, the channel is TLS), and ``tls_cert`` /
    ``tls_key`` (the client's own certificate and key, for a server that requires them)."""

    token: str = ""
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None

    @classmethod
    def build(
        cls, token: str | None, tls_ca: Pem, tls_cert: Pem = None, tls_key: Pem = None
    ) -> ChannelSecurity:
        """Read the PEM files now, so a wrong path fails before connecting, naming the argument."""
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        if tls_cert is not None and tls_ca is None:
            raise ConfigError("tls_cert needs tls_ca (a client certificate is sent over TLS only)")
        if token is not None and any(c in token for c in "\r\n"):
            raise ConfigError("token must be one line")
        return cls(
            token or "",
            _pem("tls_ca", tls_ca),
            _pem("tls_cert", tls_cert),
            _pem("tls_key", tls_key),
        )

    @classmethod
    def for_client(
        cls, settings: ClientSettings, token: str | None, tls_ca: Pem, tls_cert: Pem, tls_key: Pem
    ) -> ChannelSecurity:
        """:meth:`build` from a client's arguments, ``settings`` filling in the token and CA."""
        return cls.build(
            settings.token if token is None else token,
            (settings.tls_ca or None) if tls_ca is None else tls_ca,
            tls_cert,
            tls_key,
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials when a CA is set; ``None`` means a plain channel."""
        if self.tls_ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca,
            private_key=self.tls_key,
            certificate_chain=self.tls_cert,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def blocking_channel(target: str, security: ChannelSecurity) -> grpc.Channel:
    """A blocking channel to ``target`` with ``security`` applied."""
    credentials = security.credentials()
    options = [*_wire.CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    extra = security.metadata()
    if not extra:
        return channel
    return grpc.intercept_channel(channel, _BlockingToken(extra))


def aio_channel(
    target: str, security: ChannelSecurity, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` with ``security`` applied; ``options``: its channel
    arguments (default: no message size limit, as a client trusts its server's answers), to
    which :data:`RECONNECT_OPTIONS` are added."""
    options = [*(_wire.CHANNEL_OPTIONS if options is None else options), *RECONNECT_OPTIONS]
    extra = security.metadata()
    interceptors: list[Any] = []
    if extra:
        interceptors = [
            _AioUnaryUnary(extra),
            _AioUnaryStream(extra),
            _AioStreamUnary(extra),
            _AioStreamStream(extra),
        ]
    credentials = security.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors or None)
    return grpc.aio.secure_channel(
        target, credentials, options=options, interceptors=interceptors or None
    )


class ReconnectWatch:
    """Calls ``callback`` once (on a gRPC thread) when ``channel`` next connects afresh.

    Asking makes the channel try to connect, and it keeps trying (at most
    :data:`RECONNECT_BACKOFF_MAX_MS` apart) until it does. A connection that is up when asked
    does not count: the channel must be seen down first, so a server that is up but failing
    calls does not fire it.
    """

    #: How long gRPC's connectivity thread may go on after the last watch on a channel ends: it
    #: wakes every 0.2 s, and on a channel closed meanwhile it dies with "Channel closed!".
    SETTLE_S = 0.3

    def __init__(self, channel: grpc.Channel, callback: Callable[[], None]) -> None:
        self._channel = channel
        self._callback = callback
        self._seen_down = False
        self._lock = threading.Lock()
        self._active = True
        #: When the subscription ended (``time.monotonic()``); ``None`` while it lasts.
        self.ended_at: float | None = None
        channel.subscribe(self._on_state, try_to_connect=True)

    def _end(self) -> bool:
        with self._lock:
            if not self._active:
                return False
            self._active = False
        self._channel.unsubscribe(self._on_state)
        self.ended_at = time.monotonic()
        return True

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        if state is not grpc.ChannelConnectivity.READY:
            self._seen_down = True
            return
        if not self._seen_down or not self._end():
            return
        try:
            self._callback()
        except Exception:  # on gRPC's delivery thread an error would vanish
            logger.exception("reconnect callback failed")

    def cancel(self) -> None:
        """Stop watching (the callback is not called); a no-op once it fired."""
        self._end()


async def await_reconnect(channel: grpc.aio.Channel, callback: Callable[[], None]) -> None:
    """Call ``callback`` once when the ``grpc.aio`` ``channel`` next connects afresh: the rules
    of :class:`ReconnectWatch` (it keeps the channel trying; a connection up when asked does not
    count), awaited on the channel's event loop instead of on a gRPC thread."""
    ready = grpc.ChannelConnectivity.READY
    state = channel.get_state(try_to_connect=True)
    seen_down = state is not ready
    while not (seen_down and state is ready):
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
        seen_down = seen_down or state is not ready
    try:
        callback()
    except Exception:  # in a task nobody awaits, an error would vanish
        logger.exception("reconnect callback failed")


def when_reconnected(channel: grpc.Channel, callback: Callable[[], None]) -> ReconnectWatch:
    """Watch ``channel`` for its next fresh connection (see :class:`ReconnectWatch`)."""
    return ReconnectWatch(channel, callback)


def settle_watches(watches: Sequence[ReconnectWatch], channel: grpc.Channel | None = None) -> None:
    """Cancel ``watches`` and wait until gRPC's connectivity thread has seen them go, so the
    channel can be closed under it without that thread failing ("Channel closed!")."""
    for watch in watches:
        watch.cancel()
    polling = None if channel is None else _connectivity_polling(channel)
    if polling is not None:
        # The thread ends within a wake-up (0.2 s) of the last watch going; on a loaded machine
        # later, so wait for it rather than a fixed time, within a bound.
        deadline = time.monotonic() + _SETTLE_BOUND_S
        while polling() and time.monotonic() < deadline:
            time.sleep(0.02)
        return
    ended = [w.ended_at for w in watches if w.ended_at is not None]
    if ended:
        time.sleep(max(0.0, max(ended) + ReconnectWatch.SETTLE_S - time.monotonic()))


# Longest close() waits for gRPC's connectivity thread to end.
_SETTLE_BOUND_S = 2.0


def _connectivity_polling(channel: grpc.Channel) -> Callable[[], bool] | None:
    """A test of whether gRPC's connectivity thread for ``channel`` still runs, or ``None`` where
    this grpcio keeps it elsewhere. It reads a private detail of grpcio (the channel's
    ``_connectivity_state.polling``, through any interceptor's ``_channel``): defensively, since
    no public call says when that thread ends."""
    inner: Any = channel
    for _ in range(4):
        state = getattr(inner, "_connectivity_state", None)
        if state is not None and hasattr(state, "polling"):
            return lambda: bool(state.polling)
        inner = getattr(inner, "_channel", None)
        if inner is None:
            break
    return None


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


def _with(extra: tuple[tuple[str, str], ...], metadata: Any) -> list[tuple[str, Any]]:
    return [*(list(metadata) if metadata else []), *extra]


class _BlockingToken(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds the token metadata to every call of a blocking channel."""

    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    def _details(self, details: Any) -> _Details:
        return _Details(
            details.method,
            details.timeout,
            _with(self._extra, details.metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)


class _AioToken:
    """Adds the token metadata to every call of a ``grpc.aio`` channel (one class per kind: the
    aio channel picks interceptors by their base class)."""

    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    def _details(self, details: Any) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*_with(self._extra, details.metadata))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def _call(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._call(continuation, details, request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._call(continuation, details, request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._call(continuation, details, requests)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._call(continuation, details, requests)
