"""The ``/metrics`` endpoint: a small HTTP/1.1 server on the event loop (``server.metrics_listen``).

It runs on the server's own event loop, so a scrape reads the stores' counters on the thread that
changes them (no lock, no torn reads), and it follows the gRPC port's rules: with
``auth.tokens_file`` every scrape needs ``Authorization: Bearer <token>`` of a listed token
(401 otherwise); with ``auth.tls_cert`` it is served over TLS with the same certificate (and,
with ``auth.tls_client_ca``, requires a client certificate signed by it); beyond loopback with
neither, it is refused unless ``auth.allow_unauthenticated``
(:func:`kvstore.server.auth.check_exposure`, the rule of every port).

On a server with tenants a scrape is answered for its caller, identified as on the gRPC port
(the token's name; without tokens, the client certificate's CN, else SAN): an identity of
``auth.operators`` sees every tenant's series, a tenant's identity sees that tenant's only
(:class:`~kvstore.server.metrics.TenantView`), and any other identity is refused (403). A server
without tenants shows everything to every caller it admits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import ssl
from collections.abc import Mapping
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from kvstore.config import AuthConfig
from kvstore.errors import ConfigError
from kvstore.server.auth import load_tokens
from kvstore.server.metrics import TenantView

__all__ = ["MetricsServer"]

logger = logging.getLogger(__name__)

# A scrape request is a few hundred bytes; anything past this is not Prometheus.
_MAX_REQUEST_BYTES = 16 * 1024
_REQUEST_TIMEOUT_S = 10.0


_FORBIDDEN = b"these credentials belong to no tenant of this server and to no auth.operators\n"


class MetricsServer:
    """Serves ``registry`` at ``/metrics`` on ``listen`` (``server.metrics_listen``), with the
    credentials of ``config``.

    ``owners`` maps each caller identity to its tenant (``None``: a server without tenants, whose
    callers all see everything).
    """

    def __init__(
        self,
        registry: Collector,
        listen: str,
        config: AuthConfig,
        owners: Mapping[str, str] | None = None,
    ) -> None:
        self._registry = registry
        self._listen = listen
        self._config = config
        self._tokens = load_tokens(config.tokens_file) if config.tokens_file else None
        self._owners = owners
        self._operators = config.operator_identities
        # One view per tenant, made once: a scrape only picks.
        self._views = {
            tenant: TenantView(registry, tenant) for tenant in set((owners or {}).values())
        }
        self._server: asyncio.Server | None = None
        #: ``http(s)://HOST:PORT/metrics`` once started.
        self.url = ""

    def _ssl(self) -> ssl.SSLContext | None:
        config = self._config
        if not config.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(config.tls_cert, config.tls_key)
            if config.tls_client_ca:
                context.load_verify_locations(config.tls_client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"auth.tls_cert / tls_key: cannot load them ({exc})") from exc
        return context

    async def start(self) -> str:
        """Bind and serve; returns the URL. A port in use is an OSError naming the setting."""
        listen = self._listen
        host, _, port = listen.rpartition(":")
        context = self._ssl()
        try:
            self._server = await asyncio.start_server(
                self._handle, host.strip("[]"), int(port), ssl=context
            )
        except OSError as exc:
            raise OSError(
                f"server.metrics_listen={listen!r}: cannot listen ({exc.strerror}); choose "
                "another with --metrics-listen HOST:PORT, or '' to turn metrics off"
            ) from None
        bound = self._server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://{shown}:{bound[1]}/metrics"
        return self.url

    async def close(self) -> None:
        """Stop listening and close open scrapes."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
            if len(head) > _MAX_REQUEST_BYTES:
                raise ValueError("request too long")
            await self._answer(head.decode("latin-1"), writer)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ValueError,
            ConnectionError,
            ssl.SSLError,
        ) as exc:
            logger.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

    async def _answer(self, head: str, writer: asyncio.StreamWriter) -> None:
        lines = head.split("\r\n")
        method, path, *_ = [*lines[0].split(" "), "", ""]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            status, body, kind = "405 Method Not Allowed", b"use GET\n", "text/plain"
        elif path.split("?")[0] != "/metrics":
            status, body, kind = "404 Not Found", b"see /metrics\n", "text/plain"
        else:
            authorized, identity = self._identify(headers.get("authorization", ""), writer)
            view = self._view(identity) if authorized else None
            if not authorized:
                status, body, kind = "401 Unauthorized", b"bearer token required\n", "text/plain"
            elif view is None:
                status, body, kind = "403 Forbidden", _FORBIDDEN, "text/plain"
            else:
                status, body, kind = "200 OK", generate_latest(view), CONTENT_TYPE_LATEST
        extra = 'WWW-Authenticate: Bearer realm="kvstore"\r\n' if status.startswith("401") else ""
        writer.write(
            (
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                f"{extra}Connection: close\r\n\r\n"
            ).encode()
            + (body if method != "HEAD" else b"")
        )
        await writer.drain()

    def _identify(self, header: str, writer: asyncio.StreamWriter) -> tuple[bool, str | None]:
        """(admitted, identity): the token's name where tokens are checked (as on the gRPC port),
        else the client certificate's identity, else ``None``."""
        if self._tokens is None:
            return True, _certificate_identity(writer.get_extra_info("peercert"))
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False, None
        digest = hashlib.sha256(token.strip().encode()).digest()
        name = None
        # Compare with every stored digest, in constant time each: no early exit to time.
        for known, candidate in self._tokens.items():
            if hmac.compare_digest(digest, known):
                name = candidate
        return name is not None, name

    def _view(self, identity: str | None) -> Collector | None:
        """What ``identity`` may see: everything, its tenant's series, or nothing (``None``)."""
        if self._owners is None or (identity is not None and identity in self._operators):
            return self._registry
        tenant = self._owners.get(identity) if identity is not None else None
        return self._views[tenant] if tenant is not None else None


def _certificate_identity(certificate: Any) -> str | None:
    """The subject CN of a verified client certificate (``ssl`` getpeercert form), else its
    first subject alternative name: the identity the gRPC port gives the same certificate."""
    if not certificate:
        return None
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    names = certificate.get("subjectAltName", ())
    return str(names[0][1]) if names else None
