"""The holder's side of node authentication: admitting another node's peer read.

A peer read (``KVStore.Get`` or ``UcxTransfer.UcxGet`` carrying the ``kvstore-peer``
authenticator of :mod:`kvstore.node.peer_auth`) presents no bearer token: the auth interceptor
(:mod:`kvstore.server.auth`) hands it to :meth:`PeerGate.check`, which, before the servicer sees
the call:

1. parses the authenticator (bounded) and finds the tenant it names on this server;
2. checks that it names this node at its current boot epoch and that its MAC, under that
   tenant's peer key (:func:`~kvstore.node.peer_auth.peer_keyring` of the tenant's keyring),
   covers exactly this request: method, namespace, keys, and for UCX the endpoint and transfer
   the payloads go to; and that the read is sealed (a peer verifies every block it gets);
3. checks its freshness (:class:`~kvstore.node.peer_auth.ReplayGuard`: within the time window
   and never seen before; only authenticators that verified are remembered);
4. serves the call from that tenant (:data:`~kvstore.server.auth.peer_tenant`) and sends this
   node's proof in the answer's initial metadata.

Any failure ends the call UNAUTHENTICATED with a message that says which check failed (and never
anything secret); the server keeps serving. Only a node of a cluster index installs the gate
(``cluster.enabled``); until it registered (it has no boot epoch yet) it refuses every peer read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.block import Keyring
from kvstore.errors import AuthenticationError
from kvstore.node.peer_auth import (
    PROOF_METADATA,
    PeerAuthError,
    PeerCall,
    ReplayGuard,
    answer_proof,
    peer_keyring,
    request_digest,
    verify_call,
)
from kvstore.protocol.ucx import signed_destination
from kvstore.server.auth import peer_tenant
from kvstore.server.tenancy import Tenants

__all__ = ["LOG_EVERY_S", "PeerGate"]

logger = logging.getLogger(__name__)

#: Refused peer reads are logged at most once per this many seconds (with a count).
LOG_EVERY_S = 10.0


class PeerGate:
    """Admits peer reads to this server's ``tenants`` (see the module docstring).

    :attr:`identity` says which node this is and at which boot epoch; ``None`` (not in a cluster
    index, or not registered yet) refuses every peer read.
    """

    def __init__(self, tenants: Tenants, guard: ReplayGuard | None = None) -> None:
        self.tenants = tenants
        #: This node's id and boot epoch (``None`` until it registered in the cluster index).
        self.identity: Callable[[], tuple[str, int | None]] | None = None
        self._guard = guard if guard is not None else ReplayGuard()
        self._rings: dict[str, Keyring] = {}
        #: Peer reads admitted and refused.
        self.counters = {"admitted": 0, "refused": 0}
        self._unlogged = 0
        self._next_log = 0.0

    async def check(
        self,
        method: str,
        authenticator: str,
        request: Any,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """See the module docstring; raises :class:`~kvstore.errors.AuthenticationError`."""
        try:
            call = PeerCall.parse(authenticator)
            ring = self._verify(call, method, request)
        except PeerAuthError as exc:
            self.counters["refused"] += 1
            self._log_refusal(method, str(exc))
            raise AuthenticationError(str(exc)) from exc
        self.counters["admitted"] += 1
        peer_tenant.set(call.tenant)
        await context.send_initial_metadata(((PROOF_METADATA, answer_proof(ring, call)),))

    def _log_refusal(self, method: str, why: str) -> None:
        """One line at most every :data:`LOG_EVERY_S` (anyone may send bad authenticators)."""
        self._unlogged += 1
        now = time.monotonic()
        if now < self._next_log:
            return
        logger.warning(
            "refused a peer read (%s): %s%s",
            method,
            why,
            f" ({self._unlogged - 1} more refused since the last line)"
            if self._unlogged > 1
            else "",
        )
        self._unlogged = 0
        self._next_log = now + LOG_EVERY_S

    def _verify(self, call: PeerCall, method: str, request: Any) -> Keyring:
        if self.identity is None:
            raise PeerAuthError("this server is in no cluster index (cluster.enabled is off)")
        node, epoch = self.identity()
        if epoch is None:
            raise PeerAuthError(f"node {node!r} has not registered in the cluster index yet")
        tenant = self.tenants.named(call.tenant)
        if tenant is None:
            # Names only what the caller sent: nothing about which tenants this server has.
            raise PeerAuthError(f"tenant {call.tenant!r} is not served here")
        if not request.sealed:
            raise PeerAuthError("a peer read must ask for sealed blocks (sealed = true)")
        extra = b""
        if method == "UcxGet":
            extra = signed_destination(request)
        digest = request_digest(request.namespace, list(request.keys), extra)
        ring = self._ring(call.tenant, tenant.store.keyring)
        verify_call(ring, call, method, node, epoch, digest)
        self._guard.admit(call)  # after the MAC: a forger cannot fill the cache
        return ring

    def _ring(self, tenant: str, keyring: Keyring) -> Keyring:
        ring = self._rings.get(tenant)
        if ring is None:
            ring = self._rings[tenant] = peer_keyring(keyring)
        return ring
