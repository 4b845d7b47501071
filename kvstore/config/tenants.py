"""The ``[tenants.NAME]`` tables of a config file: who each tenant is and what it may hold.

How the server enforces them is :mod:`kvstore.server.tenancy`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvstore.config.checks import require_at_least, require_seconds
from kvstore.config.sizes import parse_size
from kvstore.errors import ConfigError

__all__ = ["TenantConfig", "tenant_tables"]

_TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


@dataclass(frozen=True)
class TenantConfig:
    """One tenant (``[tenants.NAME]`` in the config file; there are no environment variables for
    tenants). ``identities``: the gRPC callers that act as this tenant, token names from
    ``auth.tokens_file`` or client-certificate identities (CN, else SAN); ``uids`` and
    ``gids``: the local users and primary groups whose processes may connect to this tenant's
    shared-memory socket (both empty: whoever the socket's mode admits and learnt its path from an
    authenticated call). ``dram``, ``nvme`` and
    ``hbm``: the bytes this tenant may hold in each tier (its own arena, its own LMDB directory
    under ``nvme.path``; 0 leaves the tier out for this tenant). ``shm``: serve the tenant's
    co-located clients over shared memory; every process admitted to its socket then maps the
    tenant's whole arena read-only and can read any block in it (but change none), whatever
    namespace it works in, so set it only where all the tenant's engines (models, TP ranks) may
    read each other's KV. Off
    (the default): nobody maps the tenant's arena, its clients use gRPC or UCX.
    ``max_retention_s``: the longest retention this tenant's puts may ask for
    (:mod:`kvstore.retention`); ``None``: the server's ``policy.max_retention_s``. Retained
    blocks count against the tenant's tier sizes like any other."""

    name: str
    identities: tuple[str, ...] = ()
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    dram: int = 0
    nvme: int = 0
    hbm: int = 0
    shm: bool = False
    max_retention_s: float | None = None

    def __post_init__(self) -> None:
        where = f"tenants.{self.name}"
        if not _TENANT_NAME.fullmatch(self.name):
            raise ConfigError(
                f"[{where}]: a tenant name is 1-63 of a-z, 0-9, '_' and '-', starting with a "
                "letter or digit"
            )
        if not self.identities:
            raise ConfigError(
                f"{where}.identities must name at least one caller (a token name from "
                "auth.tokens_file or a client certificate's CN)"
            )
        if not (self.dram or self.nvme):
            raise ConfigError(f"{where}: give dram or nvme a size (both are 0)")
        if self.max_retention_s is not None:
            require_seconds(f"{where}.max_retention_s", self.max_retention_s)
        for tier in ("dram", "nvme", "hbm"):
            require_at_least(f"{where}.{tier}", getattr(self, tier), 0)


_TENANT_KEYS = {"identities", "uids", "gids", "dram", "nvme", "hbm", "shm", "max_retention_s"}


def tenant_tables(document: Any) -> tuple[TenantConfig, ...]:
    """The ``[tenants.NAME]`` tables of a config file, checked; an identity in two is an error."""
    if not isinstance(document, dict):
        raise ConfigError("[tenants] must hold one table per tenant: [tenants.NAME]")
    tenants: list[TenantConfig] = []
    owner: dict[str, str] = {}
    for name, table in document.items():
        if not isinstance(table, dict) or set(table) - _TENANT_KEYS:
            raise ConfigError(
                f"[tenants.{name}] takes only {sorted(_TENANT_KEYS)}, "
                f"got {sorted(table) if isinstance(table, dict) else table!r}"
            )
        try:
            identities = tuple(str(i) for i in table.get("identities", ()))
            uids = tuple(int(u) for u in table.get("uids", ()))
            gids = tuple(int(g) for g in table.get("gids", ()))
            sizes = {tier: parse_size(table.get(tier, 0)) for tier in ("dram", "nvme", "hbm")}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"[tenants.{name}]: {exc}") from exc
        shm = table.get("shm", False)
        if type(shm) is not bool:
            raise ConfigError(f"tenants.{name}.shm must be true or false, got {shm!r}")
        retention = table.get("max_retention_s")
        if retention is not None and (
            type(retention) not in (int, float) or isinstance(retention, bool)
        ):
            raise ConfigError(
                f"tenants.{name}.max_retention_s must be a number of seconds, got {retention!r}"
            )
        tenant = TenantConfig(
            str(name),
            identities,
            uids,
            gids,
            **sizes,
            shm=shm,
            max_retention_s=None if retention is None else float(retention),
        )
        for identity in tenant.identities:
            if identity in owner:
                raise ConfigError(
                    f"identity {identity!r} is in tenants {owner[identity]} and {name}: "
                    "a caller belongs to one tenant"
                )
            owner[identity] = tenant.name
        tenants.append(tenant)
    return tuple(tenants)
