"""Tests of the exception tree in :mod:`kvstore.errors` and its gRPC status mapping."""

from __future__ import annotations

import inspect

import grpc
import pytest

import kvstore.errors as errors_module
from kvstore.errors import (
    STATUS_OF,
    AuthenticationError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InternalStoreError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
    StoreUnavailableError,
    UnknownPrefetchError,
    error_from_status,
    status_of,
)

# The intended wire status of every error class (the tree drawn in the module docstring).
INTENDED: dict[type[KVStoreError], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    NamespaceMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreUnavailableError: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    InternalStoreError: grpc.StatusCode.INTERNAL,
    UnknownPrefetchError: grpc.StatusCode.NOT_FOUND,
    AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
}

# Each status code in the tree and the class a client raises for it. ConfigError shares
# INVALID_ARGUMENT with InvalidRequestError and comes back as the latter.
ROUND_TRIP: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: NamespaceMismatchError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.INTERNAL: InternalStoreError,
    grpc.StatusCode.NOT_FOUND: UnknownPrefetchError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def _defined_error_classes() -> set[type[KVStoreError]]:
    return {
        obj
        for _, obj in inspect.getmembers(errors_module, inspect.isclass)
        if issubclass(obj, KVStoreError) and obj is not KVStoreError
    }


def test_every_error_class_has_an_intended_status() -> None:
    # A new error class must be added to the mapping (and to these tests) on purpose.
    assert _defined_error_classes() == set(INTENDED)
    assert set(STATUS_OF) == set(INTENDED)


def test_every_error_class_is_exported() -> None:
    exported = set(errors_module.__all__)
    assert {cls.__name__ for cls in _defined_error_classes()} <= exported
    assert {"KVStoreError", "STATUS_OF", "error_from_status"} <= exported


@pytest.mark.parametrize("cls", list(INTENDED), ids=lambda cls: cls.__name__)
def test_error_class_maps_to_intended_status(cls: type[KVStoreError]) -> None:
    assert STATUS_OF[cls] == INTENDED[cls]
    assert status_of(cls("boom")) == INTENDED[cls]


@pytest.mark.parametrize("code", list(ROUND_TRIP), ids=lambda code: code.name)
def test_error_from_status_maps_back_to_same_class(code: grpc.StatusCode) -> None:
    error = error_from_status(code, "details here")
    assert type(error) is ROUND_TRIP[code]
    assert status_of(error) == code


@pytest.mark.parametrize(
    "cls", [c for c in INTENDED if c is not ConfigError], ids=lambda cls: cls.__name__
)
def test_class_round_trips_through_the_wire(cls: type[KVStoreError]) -> None:
    assert type(error_from_status(status_of(cls("x")), "x")) is cls


def test_config_error_arrives_as_invalid_request() -> None:
    error = error_from_status(status_of(ConfigError("bad")), "bad")
    assert type(error) is InvalidRequestError


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.DATA_LOSS,
    ],
    ids=lambda code: code.name,
)
def test_unknown_codes_map_to_internal_store_error(code: grpc.StatusCode) -> None:
    assert type(error_from_status(code, "x")) is InternalStoreError


def test_error_message_carries_code_and_details() -> None:
    error = error_from_status(grpc.StatusCode.UNAVAILABLE, "redis down")
    assert str(error) == "UNAVAILABLE: redis down"
    assert str(error_from_status(grpc.StatusCode.INTERNAL, None)) == "INTERNAL: no details"
    assert str(error_from_status(grpc.StatusCode.INTERNAL, "")) == "INTERNAL: no details"


def test_status_of_uses_nearest_mapped_base_class() -> None:
    class TierFullError(CapacityError):
        pass

    class UnmappedError(KVStoreError):
        pass

    assert status_of(TierFullError()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(UnmappedError()) == grpc.StatusCode.INTERNAL
    assert status_of(KVStoreError()) == grpc.StatusCode.INTERNAL


def test_config_error_is_a_value_error_and_a_kvstore_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, KVStoreError)
    with pytest.raises(ValueError):
        raise ConfigError("bad setting")


@pytest.mark.parametrize("cls", list(INTENDED), ids=lambda cls: cls.__name__)
def test_every_error_is_a_kvstore_error(cls: type[KVStoreError]) -> None:
    assert issubclass(cls, KVStoreError)
    assert issubclass(cls, Exception)


def test_only_config_error_is_a_value_error() -> None:
    assert [cls for cls in INTENDED if issubclass(cls, ValueError)] == [ConfigError]
