"""Who may call the server: TLS, client certificates, bearer tokens, and where it may listen.

* ``auth.tls_cert``/``auth.tls_key`` serve gRPC over TLS; ``auth.tls_client_ca``
  additionally requires every client to present a certificate signed by that CA (mTLS: the TLS
  handshake refuses the others before any call).
* ``auth.tokens_file`` names a text file of bearer tokens, stored hashed: one ``NAME SHA256HEX``
  per line (``#`` starts a comment), where ``SHA256HEX`` is the hex SHA-256 of the token, e.g.
  ``printf %s "$TOKEN" | sha256sum``. Every call must then carry ``authorization: Bearer
  <token>`` metadata; :class:`AuthInterceptor` checks it on every service of the server (the
  KVStore and the UCX control service) except the standard health service, which probes must
  reach, and answers UNAUTHENTICATED otherwise.
* The caller's identity (the token's NAME, else the certificate's subject CN or SAN) is put in
  :data:`caller_identity` for the call; tenants will be mapped from it.
* :func:`check_exposure`: a server without tokens or client certificates refuses to listen beyond
  loopback unless ``auth.allow_unauthenticated`` says so.
* Another node's peer read (``KVStore.Get``, ``UcxTransfer.UcxGet``) carrying an authenticator
  (:mod:`kvstore.node.peer_auth`) needs no bearer token: the interceptor hands it to the
  server's :data:`PeerCheck` instead, which verifies it against the request itself and serves the
  call from the tenant it proves (:data:`peer_tenant`), or ends it UNAUTHENTICATED. Whatever a
  call carries, it is one or the other: an authenticator that fails is never excused by a token.

The shared-memory socket is not covered here: it is local, and its peers are identified by their
uid (SO_PEERCRED) and admitted by the socket's permission bits.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import inspect
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore.config import AuthConfig, Config
from kvstore.errors import AuthenticationError, ConfigError
from kvstore.node.peer_auth import CALL_METADATA, MAX_METADATA_CHARS, PEER_METHODS
from kvstore.server.placeholders import check_token_digest

__all__ = [
    "HEALTH_PREFIX",
    "AuthInterceptor",
    "PeerCheck",
    "caller_identity",
    "check_exposure",
    "interceptors",
    "is_loopback",
    "load_tokens",
    "peer_tenant",
    "server_credentials",
]

logger = logging.getLogger(__name__)

#: Methods under this prefix (the standard health service) need no credentials.
HEALTH_PREFIX = "/grpc.health.v1.Health/"

#: The identity of the caller of the call being served (``None``: no authentication configured).
caller_identity: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvstore_caller_identity", default=None
)

#: The tenant a verified peer read is served from (``None``: the call is no peer read). Set only
#: by the server's :data:`PeerCheck` once the authenticator verified.
peer_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvstore_peer_tenant", default=None
)

#: Verifies a peer read: ``(method, authenticator, request, context)``; raises
#: :class:`~kvstore.errors.AuthenticationError` (the message says why), else sets
#: :data:`peer_tenant` and sends the holder's proof in the initial metadata.
PeerCheck = Callable[[str, str, Any, "grpc.aio.ServicerContext[Any, Any]"], Awaitable[None]]

_HEX = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.@:/-]{1,128}")
_MISSING = (
    "this server requires a bearer token: pass token=... to KVStoreClient / AsyncKVStoreClient, "
    "or set KVSTORE_TOKEN (--token for the kvstore command)"
)
_REFUSED = "the bearer token was not accepted by this server: check token=... / KVSTORE_TOKEN"
_MALFORMED = "the authorization metadata must be 'Bearer <token>'"


def load_tokens(path: str) -> dict[bytes, str]:
    """The tokens of ``path``: SHA-256 digest -> NAME. A bad line, or the hash of a public token
    (:mod:`kvstore.server.placeholders`), is a ConfigError naming it."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"auth.tokens_file: cannot read {path} ({exc})") from exc
    tokens: dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2 or not _NAME.fullmatch(words[0]) or not _HEX.fullmatch(words[1]):
            raise ConfigError(
                f"auth.tokens_file {path} line {number}: expected 'NAME SHA256HEX' (the hex "
                "SHA-256 of the token, 64 lowercase hex digits; never the token itself)"
            )
        digest = bytes.fromhex(words[1])
        check_token_digest(digest, f"auth.tokens_file {path} line {number} ({words[0]})")
        tokens[digest] = words[0]
    if not tokens:
        raise ConfigError(f"auth.tokens_file {path} holds no token: every call would be refused")
    return tokens


def is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` listens on loopback only (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(config: Config) -> None:
    """Refuse (ConfigError, one line) to listen beyond loopback with nobody authenticated: the
    gRPC port, the UCX listener and the metrics endpoint alike."""
    server, auth = config.server, config.auth
    if auth.tokens_file and not auth.tls_cert and not is_loopback(server.listen):
        logger.warning(
            "auth.tokens_file without auth.tls_cert on %s: bearer tokens cross the network "
            "in clear; configure TLS",
            server.listen,
        )
    if auth.authenticates or auth.allow_unauthenticated:
        return
    fix = (
        "configure auth.tokens_file or auth.tls_client_ca, or set "
        "auth.allow_unauthenticated = true (--allow-unauthenticated) to serve anyone who can "
        "reach it"
    )
    if not is_loopback(server.listen):
        raise ConfigError(
            f"server.listen = {server.listen} is beyond loopback and no client is authenticated: "
            + fix
        )
    if config.ucx.listen:
        # ucxx binds the port on every interface whatever the host says.
        raise ConfigError(
            f"ucx.listen = {config.ucx.listen} listens on every interface and no client "
            "is authenticated: " + fix
        )
    if server.metrics_listen and not is_loopback(server.metrics_listen):
        raise ConfigError(
            f"server.metrics_listen = {server.metrics_listen} is beyond loopback and no client is "
            f"authenticated: {fix}; or listen on loopback (--metrics-listen 127.0.0.1:9464; '' "
            "turns the endpoint off)"
        )


def server_credentials(auth: AuthConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (``None``: plain)."""
    if not auth.tls_cert:
        return None
    pem: dict[str, bytes | None] = {}
    for setting in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(auth, setting)
        try:
            pem[setting] = Path(path).read_bytes() if path else None
        except OSError as exc:
            raise ConfigError(f"auth.{setting}: cannot read {path} ({exc})") from exc
    key, cert = pem["tls_key"], pem["tls_cert"]
    assert key is not None and cert is not None  # the config checks they come together
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=pem["tls_client_ca"],
        require_client_auth=pem["tls_client_ca"] is not None,
    )


def interceptors(
    auth: AuthConfig, peer_check: PeerCheck | None = None
) -> list[grpc.aio.ServerInterceptor[Any, Any]]:
    """The interceptors the server's settings call for (none without tokens, client CA or a
    check of peer reads)."""
    tokens = load_tokens(auth.tokens_file) if auth.tokens_file else {}
    if not tokens and not auth.tls_client_ca and peer_check is None:
        return []
    return [
        AuthInterceptor(tokens, client_certificates=bool(auth.tls_client_ca), peer_check=peer_check)
    ]


def _certificate_identity(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    auth = context.auth_context()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        values = auth.get(key)
        if values:
            return bytes(next(iter(values))).decode(errors="replace")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Checks the bearer token of every call (health excepted) and records the caller's identity.

    ``tokens`` maps SHA-256 digests to names (empty: no token needed, e.g. mTLS only);
    ``client_certificates`` says the TLS port requires client certificates, whose CN names the
    caller when no token does.
    """

    def __init__(
        self,
        tokens: dict[bytes, str],
        *,
        client_certificates: bool,
        peer_check: PeerCheck | None = None,
    ) -> None:
        self._tokens = tokens
        self._client_certificates = client_certificates
        self._peer_check = peer_check

    def _check(self, metadata: Sequence[Any] | None) -> tuple[str | None, str | None]:
        """(token name, None) for a good token, (None, why) otherwise."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return None, _MISSING
        value = values[0]
        scheme, _, token = (value.decode() if isinstance(value, bytes) else value).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, _MALFORMED
        digest = hashlib.sha256(token.strip().encode()).digest()
        name = None
        # Compare with every stored digest, in constant time each: no early exit to time.
        for stored, candidate in self._tokens.items():
            if hmac.compare_digest(stored, digest):
                name = candidate
        return (name, None) if name is not None else (None, _REFUSED)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        if self._peer_check is not None and method in PEER_METHODS:
            authenticator = _metadata_value(handler_call_details.invocation_metadata)
            if authenticator is not None:
                return _same_kind(handler, self._peer(handler, method, authenticator))
        name = None
        if self._tokens:
            name, problem = self._check(handler_call_details.invocation_metadata)
            if problem is not None:
                logger.debug("refused %s: %s", method, problem)
                return _same_kind(handler, _refuse(problem))
        return _same_kind(handler, self._identified(handler, method, name))

    def _peer(self, handler: Any, method: str, authenticator: str) -> Callable[..., Any]:
        """The handler's behaviour, run once the peer check admitted the call."""
        behavior = _behavior(handler)
        check = self._peer_check
        assert check is not None

        async def admit(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            caller_identity.set(None)  # a peer read has no caller identity, only its tenant
            try:
                await check(PEER_METHODS[method], authenticator, request, context)
            except AuthenticationError as exc:  # the check logs it (rate-limited)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"peer read refused: {exc}")

        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await admit(request, context)
                async for message in behavior(request, context):
                    yield message

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(request, context)
            return await behavior(request, context)

        return call

    def _identified(self, handler: Any, method: str, name: str | None) -> Callable[..., Any]:
        """The handler's behaviour, run with :data:`caller_identity` set."""
        behavior = _behavior(handler)
        certificates = self._client_certificates

        def identify(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            identity = name
            if identity is None and certificates:
                identity = _certificate_identity(context)
            caller_identity.set(identity)
            logger.debug("%s called by %s", method, identity)

        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                identify(context)
                async for message in behavior(request, context):
                    yield message

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            identify(context)
            return await behavior(request, context)

        return call


def _metadata_value(metadata: Sequence[Any] | None) -> str | None:
    """The peer authenticator a call carries (bounded; ``None``: none)."""
    for key, value in metadata or ():
        if key == CALL_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            return text[: MAX_METADATA_CHARS + 1]  # longer fails the parse, naming the bound
    return None


def _refuse(message: str) -> Callable[..., Awaitable[None]]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refuse


def _behavior(handler: Any) -> Callable[..., Any]:
    return (  # type: ignore[no-any-return]
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )


def _same_kind(handler: Any, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A method handler of ``handler``'s kind and (de)serializers running ``behavior``."""
    if handler.request_streaming:
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
    else:
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
