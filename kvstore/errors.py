"""The one exception tree of kvstore, shared by the server and the clients.

::

    KVStoreError                                       gRPC status
    ├── ConfigError             bad setting (a ValueError)  INVALID_ARGUMENT
    ├── InvalidRequestError     malformed request           INVALID_ARGUMENT
    ├── NamespaceMismatchError  key held by another ns      FAILED_PRECONDITION
    ├── CapacityError           over a limit or a tier      RESOURCE_EXHAUSTED
    ├── UnknownPrefetchError    no such prefetch id         NOT_FOUND
    ├── AuthenticationError     missing or wrong credentials UNAUTHENTICATED
    ├── PermissionDeniedError   credentials of no tenant    PERMISSION_DENIED
    ├── StoreUnavailableError   store cannot be reached     UNAVAILABLE
    ├── DeadlineExceededError   deadline passed             DEADLINE_EXCEEDED
    └── InternalStoreError      anything else               INTERNAL

The server raises these from the store core; the servicer maps each to its gRPC status code
(:data:`STATUS_OF`), and the clients map status codes back (:func:`error_from_status`), so a caller
catches the same class whether the error happened in-process or across the wire.
"""

from __future__ import annotations

import grpc

__all__ = [
    "STATUS_OF",
    "AuthenticationError",
    "CapacityError",
    "ConfigError",
    "DeadlineExceededError",
    "InternalStoreError",
    "InvalidRequestError",
    "KVStoreError",
    "NamespaceMismatchError",
    "PermissionDeniedError",
    "StoreUnavailableError",
    "UnknownPrefetchError",
    "error_from_status",
    "status_of",
]


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class InvalidRequestError(KVStoreError):
    """The request is malformed: wrong key length, empty or oversized batch, bad argument."""


class NamespaceMismatchError(KVStoreError):
    """A key is already stored under a different namespace fingerprint."""


class CapacityError(KVStoreError):
    """A block or a batch exceeds a configured limit or the capacity of a whole tier."""


class UnknownPrefetchError(KVStoreError):
    """No prefetch has this id: never issued, or finished long ago and forgotten."""


class AuthenticationError(KVStoreError):
    """The server wants credentials this call did not carry, or refused the ones it did."""


class PermissionDeniedError(KVStoreError):
    """The caller is authenticated but may not do this (its credentials belong to no tenant)."""


class StoreUnavailableError(KVStoreError):
    """The store, or the tier the operation needs, cannot be reached right now."""


class DeadlineExceededError(KVStoreError):
    """The call did not complete within its deadline."""


class InternalStoreError(KVStoreError):
    """The server failed in a way the request did not cause."""


STATUS_OF: dict[type[KVStoreError], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    NamespaceMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnknownPrefetchError: grpc.StatusCode.NOT_FOUND,
    AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    StoreUnavailableError: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    InternalStoreError: grpc.StatusCode.INTERNAL,
}

_ERROR_OF: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: NamespaceMismatchError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.NOT_FOUND: UnknownPrefetchError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def status_of(error: KVStoreError) -> grpc.StatusCode:
    """Return the gRPC status code that carries ``error`` over the wire."""
    for cls in type(error).__mro__:
        code = STATUS_OF.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, details: str | None) -> KVStoreError:
    """Build the kvstore exception that corresponds to a gRPC status code."""
    cls = _ERROR_OF.get(code, InternalStoreError)
    return cls(f"{code.name}: {details or 'no details'}")
