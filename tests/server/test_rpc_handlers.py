"""The gRPC handler tables come from the services' descriptors (``kvstore.server.rpc``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
from grpc_health.v1 import health_pb2

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2
from kvstore.server.rpc import Undecodable, service_handler


class _CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...] = ()


async def _noop(*_: Any) -> None:
    return None


@pytest.mark.parametrize(
    "service",
    [
        pb.DESCRIPTOR.services_by_name["KVStore"],
        ucx_pb2.DESCRIPTOR.services_by_name["UcxTransfer"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
    ],
    ids=lambda service: service.full_name,
)
def test_every_method_is_served_with_its_declared_shape_and_types(service: Any) -> None:
    generic = service_handler(service, {method.name: _noop for method in service.methods})
    for method in service.methods:
        handler = generic.service(_CallDetails(f"/{service.full_name}/{method.name}"))
        assert handler is not None, method.name
        assert handler.request_streaming == method.client_streaming, method.name
        assert handler.response_streaming == method.server_streaming, method.name
        request = handler.request_deserializer(b"")  # an empty message decodes to defaults
        assert request.DESCRIPTOR is method.input_type, method.name
        # Garbage reaches the handler as Undecodable (answered INVALID_ARGUMENT), not UNKNOWN.
        assert isinstance(handler.request_deserializer(b"\xff\xff\xff"), Undecodable)
    assert generic.service(_CallDetails(f"/{service.full_name}/NoSuchMethod")) is None


def test_ucx_put_answers_with_the_kvstore_put_response() -> None:
    service = ucx_pb2.DESCRIPTOR.services_by_name["UcxTransfer"]
    generic = service_handler(service, {method.name: _noop for method in service.methods})
    handler = generic.service(_CallDetails(f"/{service.full_name}/UcxPut"))
    assert handler is not None
    assert (
        handler.response_serializer(pb.PutResponse(stored=3))
        == pb.PutResponse(stored=3).SerializeToString()
    )


def test_a_method_without_a_handler_is_refused_at_registration() -> None:
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {method.name: _noop for method in service.methods if method.name != "Delete"}
    with pytest.raises(ValueError, match=r"missing for \['Delete'\]"):
        service_handler(service, handlers)


def test_a_handler_for_an_undeclared_method_is_refused() -> None:
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {method.name: _noop for method in service.methods} | {"Shutdown": _noop}
    with pytest.raises(ValueError, match=r"undeclared methods \['Shutdown'\]"):
        service_handler(service, handlers)
