"""The ``KeyScheme`` call: an engine declares its namespace and learns how to name chunks.

The node's :class:`~kvstore.node.key_schemes.NodeKeySchemes` holds its configured chunk size and
hash algorithm (``[keys]``); each engine's connector declares its base namespace and the
fingerprint of its key secret at start, and uses the chunk size and algorithm of the answer
(:mod:`kvstore.key_scheme`). The refusals each have their own status, so the connector can say
which it met: a different secret is FAILED_PRECONDITION, a namespace of another tenant
PERMISSION_DENIED, one namespace too many RESOURCE_EXHAUSTED, a malformed or oversized request
INVALID_ARGUMENT (:func:`kvstore.protocol.checks.check_key_scheme_request`).
"""

from __future__ import annotations

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import (
    CapacityError,
    NamespaceMismatchError,
    PermissionDeniedError,
)
from kvstore.node.key_schemes import NodeKeySchemes, SecretMismatch, TooManySchemes
from kvstore.protocol.messages import declared_namespace, key_scheme_response

__all__ = ["declare"]


def declare(
    schemes: NodeKeySchemes, tenant: str, request: pb.KeySchemeRequest
) -> pb.KeySchemeResponse:
    """Declare the request's namespace to ``schemes`` for a caller of ``tenant`` (its name from
    its credentials; "" on a server without tenants) and answer the scheme to use."""
    namespace = declared_namespace(request)
    # A server with tenants knows who calls: an engine declares only its own tenant's namespace
    # (without tenants, ``Namespace.tenant`` is only a part of the namespace, any value goes).
    if tenant and namespace.tenant != tenant:
        raise PermissionDeniedError(
            f"the declared namespace's tenant {namespace.tenant!r} is not yours ({tenant!r}): "
            "set the connector's tenant to the tenant your credentials belong to"
        )
    try:
        scheme = schemes.declare(namespace, request.secret_check)
    except SecretMismatch as exc:
        raise NamespaceMismatchError(str(exc)) from None
    except TooManySchemes as exc:
        raise CapacityError(str(exc)) from None
    return key_scheme_response(scheme)
