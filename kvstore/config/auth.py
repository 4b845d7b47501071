"""Who may call the server (``[auth]``, enforced by :mod:`kvstore.server.auth`): TLS, client
certificates, bearer tokens, and the operators who see every tenant's metrics. A plain frozen
dataclass that checks its own values; :mod:`kvstore.config` loads it. Until this release these
were ``server.tls_*``, ``server.tokens_file``, ``server.allow_unauthenticated`` and
``server.operators``; those names are still read, with a warning."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.meta import setting
from kvstore.errors import ConfigError

__all__ = ["AuthConfig"]


@dataclass(frozen=True)
class AuthConfig:
    """``tls_cert``/``tls_key`` (PEM files) serve gRPC over TLS; ``tls_client_ca`` (PEM) then
    requires a client certificate signed by it; ``tokens_file`` names a file of
    ``NAME SHA256HEX`` lines (bearer tokens, stored hashed) that every call must match;
    ``allow_unauthenticated`` lets a server without either listen beyond loopback
    (``server.listen`` or any ``ucx.listen``). ``operators``: comma-separated identities (token
    names or certificate CNs) whose ``/metrics`` scrapes show every tenant's series; any other
    caller of a server with tenants sees its own tenant's only."""

    tls_cert: str = setting(
        "",
        help="PEM certificate (chain): serve gRPC over TLS; needs `auth.tls_key`",
        flag="--tls-cert",
        old_names=("server.tls_cert",),
        metavar="FILE",
        short="PEM certificate: serve gRPC over TLS (with --tls-key)",
    )
    tls_key: str = setting(
        "",
        help="PEM private key of `auth.tls_cert`",
        flag="--tls-key",
        old_names=("server.tls_key",),
        metavar="FILE",
    )
    tls_client_ca: str = setting(
        "",
        help=(
            "PEM CA: every client must present a certificate it signed (mTLS; the handshake "
            "refuses others); the certificate's CN (else SAN) names the caller"
        ),
        flag="--tls-client-ca",
        old_names=("server.tls_client_ca",),
        metavar="FILE",
        short="PEM CA: require client certificates signed by it (mTLS)",
    )
    tokens_file: str = setting(
        "",
        help=(
            "bearer tokens, stored hashed: one `NAME SHA256HEX` per line (`#` comments; `printf %s"
            ' "$TOKEN" | sha256sum` gives the hash). Every call except the health service must '
            "carry `authorization: Bearer <token>` (clients: `token=` or `KVSTORE_TOKEN`), else "
            "`UNAUTHENTICATED`; other nodes' peer reads carry an authenticator instead (see "
            "[Cluster index](#cluster-index))"
        ),
        flag="--tokens-file",
        old_names=("server.tokens_file",),
        metavar="FILE",
        short="file of 'NAME SHA256HEX' lines: bearer tokens, stored hashed",
    )
    allow_unauthenticated: bool = setting(
        False,
        help=(
            "without tokens or client certificates the server refuses to start when "
            "`server.listen` is beyond loopback or `ucx.listen` is set (the UCX listener binds "
            "every interface); `true` starts it anyway"
        ),
        flag="--allow-unauthenticated",
        old_names=("server.allow_unauthenticated",),
        short="listen beyond loopback with neither tokens nor client certificates",
    )
    operators: str = setting(
        "",
        help=(
            "identities (token names, or client-certificate CNs) whose `/metrics` scrapes show "
            "every tenant's series; comma-separated (a list in TOML). On a server with tenants any"
            " other caller sees its own tenant's series only, and a caller of neither gets 403. "
            "Each must be a token name where tokens are the only credentials, and no tenant's "
            "identity"
        ),
        kind="list",
        old_names=("server.operators",),
    )

    @property
    def operator_identities(self) -> frozenset[str]:
        """The identities of ``operators``."""
        return frozenset(part.strip() for part in self.operators.split(",") if part.strip())

    @property
    def authenticates(self) -> bool:
        """Whether callers are told apart: bearer tokens or client certificates."""
        return bool(self.tokens_file or self.tls_client_ca)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("auth.tls_cert and auth.tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("auth.tls_client_ca needs auth.tls_cert and auth.tls_key (TLS)")
