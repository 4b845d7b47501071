"""The ``KeyScheme`` messages both sides build and read (``kvstore.protocol.messages``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InternalStoreError, InvalidRequestError
from kvstore.keys import Namespace
from kvstore.protocol.messages import (
    declared_namespace,
    key_scheme_request,
    key_scheme_result,
)

NS = Namespace(model="m", num_layers=2, tenant="t")


def test_a_declaration_carries_the_base_namespace_only() -> None:
    request = key_scheme_request(NS.for_request("adapter", "salt"), "0" * 16)
    fields = json.loads(request.namespace)
    assert "lora_id" not in fields and "cache_salt" not in fields and "tp_rank" not in fields
    assert declared_namespace(request) == NS
    ranked = key_scheme_request(dataclasses.replace(NS, tp_rank=1, tp_size=2), "")
    assert declared_namespace(ranked) == dataclasses.replace(NS, tp_rank=0, tp_size=2)


def test_an_answer_becomes_the_scheme_of_the_declared_base() -> None:
    answer = pb.KeySchemeResponse(
        chunk_size=128, hash_algorithm="sha256", secret_env="S", secret_check="ab" * 8
    )
    scheme = key_scheme_result(answer, NS.for_request("adapter", ""))
    assert (scheme.chunk_size, scheme.hash_algorithm, scheme.namespace) == (128, "sha256", NS)
    assert (scheme.secret_env, scheme.secret_check) == ("S", "ab" * 8)


@pytest.mark.parametrize(
    "answer",
    [pb.KeySchemeResponse(chunk_size=0), pb.KeySchemeResponse(chunk_size=8, hash_algorithm="md5")],
)
def test_an_unusable_answer_is_the_servers_fault(answer: pb.KeySchemeResponse) -> None:
    with pytest.raises(InternalStoreError, match="unusable key scheme"):
        key_scheme_result(answer, NS)


def test_a_bad_declaration_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequestError, match="tenant must be a JSON string"):
        declared_namespace(pb.KeySchemeRequest(namespace='{"model": "m", "tenant": 7}'))
