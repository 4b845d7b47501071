"""Tenants: which store serves a caller, decided by the server from the caller's credentials.

A server without ``[tenants]`` has one store that every caller shares (the single-team set-up,
as before tenants existed). A server with tenants gives each its own complete store: its own dram
arena (sized by its ``dram`` quota), its own LMDB directory (``nvme.path/tenants/NAME``, sized by
its ``nvme`` quota), its own place in Redis (``redis.key_prefix`` + ``t:NAME:``), its own integrity
keyring (the cluster secrets bound to its name, :meth:`~kvstore.block.Keyring.for_tenant`), its own
prefetch queue, in-flight budget and shared-memory socket. Nothing a tenant can name reaches
another tenant's blocks:

- the tenant comes from the credentials the server checked (:data:`~kvstore.server.auth.
  caller_identity`: a token's name or a client certificate's identity), never from the request;
  a caller whose identity is in no tenant is refused (PERMISSION_DENIED);
- keys, namespaces, errors and stats are all answered from the caller's own store, so the same
  key held by another tenant is simply absent (no "stored under another namespace" oracle);
- a value copied in Redis or on disk from one tenant's place to another's fails the MAC check
  there (a miss, counted), because each tenant's keyring differs;
- co-located clients get the socket of their own tenant's arena (``DataPlane`` answers with it),
  only where the tenant's ``shm`` says its engines may read each other's KV (whoever maps an
  arena can read all of it, whatever namespace it works in, and change none of it: the arena is
  sealed, :mod:`kvstore.server.shm_window`); that socket has a random name in an
  unlistable directory of its own (:func:`~kvstore.server.shm_paths.tenant_socket_path`), so no
  tenant derives another's path from its own, and it admits only the tenant's ``uids`` and
  ``gids`` (``SO_PEERCRED``) where it lists any (a warning at start where it lists none).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvstore.config import Config, TenantConfig, default_inflight_bytes
from kvstore.errors import ConfigError, PermissionDeniedError
from kvstore.server.auth import caller_identity, load_tokens, peer_tenant
from kvstore.server.budget import InflightBudget
from kvstore.server.keyring_check import KeyringRecord
from kvstore.server.shm import ShmServer
from kvstore.store import TieredStore
from kvstore.store.prefetch import Prefetcher

__all__ = ["TENANTS_DIR", "Tenant", "Tenants", "check_tenants", "tenant_config"]

#: Where each tenant's LMDB directory lives, under ``nvme.path``.
TENANTS_DIR = "tenants"


@dataclass
class Tenant:
    """One tenant's share of the server (``name`` "": the store of a server without tenants)."""

    name: str
    store: TieredStore
    prefetcher: Prefetcher
    budget: InflightBudget
    #: The local users and primary groups whose processes may connect to this tenant's socket
    #: (both ``None``: any).
    uids: frozenset[int] | None = None
    gids: frozenset[int] | None = None
    shm: ShmServer | None = None
    #: Its ``shm.socket`` setting ("": no shared-memory data plane).
    socket_setting: str = ""
    #: Its entry in its shared tier's keyring record (``None``: no shared tier configured).
    keyring_record: KeyringRecord | None = None

    @property
    def shm_socket(self) -> str:
        """The path of this tenant's shared-memory socket ("" where it has none)."""
        return self.shm.path if self.shm is not None else ""

    @property
    def instance_id(self) -> bytes:
        """The id its shared-memory server greets with (b"" where it has none)."""
        return self.shm.instance_id if self.shm is not None else b""


class Tenants:
    """The tenants of one server, and the rule that picks the calling one.

    ``owners`` maps each caller identity to its tenant's name; ``None`` (a server without tenants)
    gives every caller the one tenant there is.
    """

    def __init__(self, tenants: Sequence[Tenant], owners: Mapping[str, str] | None = None) -> None:
        if not tenants:
            raise ValueError("a server has at least one tenant")
        if owners is None and len(tenants) != 1:
            raise ValueError("several tenants need a map from identities to tenants")
        self._tenants = list(tenants)
        by_name = {tenant.name: tenant for tenant in tenants}
        self._owners = None if owners is None else {i: by_name[n] for i, n in owners.items()}

    @classmethod
    def single(cls, tenant: Tenant) -> Tenants:
        """Every caller gets ``tenant``."""
        return cls([tenant])

    def current(self) -> Tenant:
        """The tenant of the call being served; :class:`PermissionDeniedError` if there is none.
        A peer read another node authenticated is served from the tenant it proved."""
        proved = peer_tenant.get()
        if proved is not None:
            tenant = self.named(proved)
            if tenant is None:  # the peer gate checked it exists: not reached
                raise PermissionDeniedError(f"tenant {proved!r} is not served here")
            return tenant
        if self._owners is None:
            return self._tenants[0]
        identity = caller_identity.get()
        tenant = self._owners.get(identity) if identity is not None else None
        if tenant is None:
            # Names only what the caller itself presented: nothing about other tenants.
            raise PermissionDeniedError(
                f"the credentials {identity!r} belong to no tenant of this server "
                "(an operator adds them to a [tenants.NAME] identities list)"
            )
        return tenant

    def named(self, name: str) -> Tenant | None:
        """The tenant called ``name`` ("" for a server without tenants), else ``None``."""
        return next((tenant for tenant in self._tenants if tenant.name == name), None)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)


def tenant_config(config: Config, tenant: TenantConfig) -> Config:
    """The configuration of ``tenant``'s own store: the server's, with the tenant's quotas and
    places (arena size, LMDB directory and size, Redis prefix, in-flight budget, longest
    retention), and its
    shared-memory socket setting: the server's where the tenant's ``shm`` is on, else off."""
    nvme_path = (
        os.path.join(config.nvme.path, TENANTS_DIR, tenant.name)
        if config.nvme.path and tenant.nvme
        else ""
    )
    server = config.server
    return dataclasses.replace(
        config,
        hbm=dataclasses.replace(config.hbm, capacity=tenant.hbm),
        dram=dataclasses.replace(config.dram, capacity=tenant.dram),
        nvme=dataclasses.replace(
            config.nvme, path=nvme_path, capacity=tenant.nvme or config.nvme.capacity
        ),
        redis=dataclasses.replace(
            config.redis, key_prefix=f"{config.redis.key_prefix}t:{tenant.name}:"
        ),
        server=dataclasses.replace(
            server,
            # Each tenant's requests hold at most a quarter of its own arena (at least 64 MiB),
            # and never more than the server-wide setting: one tenant cannot starve another.
            inflight_bytes=min(server.inflight_bytes, default_inflight_bytes(tenant.dram)),
        ),
        shm=dataclasses.replace(config.shm, socket=config.shm.socket if tenant.shm else ""),
        policy=dataclasses.replace(
            config.policy,
            max_retention_s=(
                config.policy.max_retention_s
                if tenant.max_retention_s is None
                else tenant.max_retention_s
            ),
        ),
        tenants=(),
    )


def check_tenants(config: Config) -> None:
    """Refuse (ConfigError) tenants the server could not tell apart, and operators it could not
    recognise.

    Tenants are told apart by credentials, so a server with tenants must check them (tokens or
    client certificates); where tokens are the only credentials, every identity a tenant or
    ``auth.operators`` lists must be a token name. An operator is no tenant's identity: the
    one sees every tenant's metrics, the other one tenant's blocks.
    """
    auth = config.auth
    operators = auth.operator_identities
    if not config.tenants and not operators:
        return
    if config.tenants and not auth.authenticates:
        raise ConfigError(
            "[tenants] needs credentials to tell callers apart: set auth.tokens_file "
            "(bearer tokens) or auth.tls_client_ca (client certificates)"
        )
    if auth.tokens_file and not auth.tls_client_ca:
        names = set(load_tokens(auth.tokens_file).values())
        for tenant in config.tenants:
            unknown = sorted(set(tenant.identities) - names)
            if unknown:
                raise ConfigError(
                    f"tenants.{tenant.name}.identities names {unknown}, which are no token "
                    f"names in auth.tokens_file ({auth.tokens_file})"
                )
        if sorted(operators - names):
            raise ConfigError(
                f"auth.operators names {sorted(operators - names)}, which are no token names "
                f"in auth.tokens_file ({auth.tokens_file})"
            )
    for tenant in config.tenants:
        both = sorted(operators & set(tenant.identities))
        if both:
            raise ConfigError(
                f"{both} are in auth.operators and in tenants.{tenant.name}.identities: give "
                "the operator a token (or certificate) of its own"
            )
