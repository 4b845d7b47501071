"""Protobuf messages in and out, shared by the sync and async clients."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.buffers import byte_view, writable_byte_view
from kvstore.errors import (
    ConfigError,
    DeadlineExceededError,
    InternalStoreError,
    InvalidRequestError,
    KVStoreError,
    error_from_status,
)
from kvstore.key_scheme import KeyScheme, engine_base, namespace_from_json, namespace_to_json
from kvstore.keys import Namespace
from kvstore.protocol.checks import check_key_scheme_request, check_pairs
from kvstore.retention import KEEP, Retention
from kvstore.types import LookupResult, PrefetchProgress, PrefetchState, PutResult

#: Soft size of one streamed Put or Get message; a single larger block still goes out whole.
MESSAGE_TARGET_BYTES = 4 * 1024**2

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def namespace_bytes(namespace: Namespace | bytes | None) -> bytes:
    """The 16-byte fingerprint of a namespace (or the fingerprint itself)."""
    if namespace is None:
        raise InvalidRequestError(
            "this call needs a namespace: pass namespace=Namespace(model=...) to the client"
        )
    return namespace.fingerprint() if isinstance(namespace, Namespace) else bytes(namespace)


def map_rpc_error(exc: grpc.RpcError) -> KVStoreError:
    """The kvstore exception for a failed call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"deadline exceeded: {details}")
    return error_from_status(code, details)


def lookup_request(namespace: bytes, keys: Sequence[bytes]) -> pb.LookupRequest:
    """A Lookup request."""
    return pb.LookupRequest(namespace=namespace, keys=list(keys))


def lookup_result(response: pb.LookupResponse) -> LookupResult:
    """The domain result of a Lookup response."""
    return LookupResult(response.hits, list(response.tiers))


def put_requests(
    namespace: bytes,
    keys: Sequence[bytes],
    values: Sequence[Any],
    retention: Retention = KEEP,
) -> Iterator[pb.PutRequest]:
    """The messages of one Put stream, about :data:`MESSAGE_TARGET_BYTES` each; the first one
    carries the namespace and the retention."""
    check_pairs(keys, values, "values")
    views = [byte_view(value) for value in values]  # check every value before sending any
    blocks: list[pb.Block] = []
    size = 0
    first = True

    def message() -> pb.PutRequest:
        if not first:
            return pb.PutRequest(blocks=blocks)
        return pb.PutRequest(
            namespace=namespace,
            blocks=blocks,
            retention_s=retention.seconds,
            retention_tiers="" if retention.tiers == "all" else retention.tiers,
        )

    for key, view in zip(keys, views, strict=True):
        blocks.append(pb.Block(key=key, value=bytes(view)))
        size += len(view)
        if size >= MESSAGE_TARGET_BYTES:
            yield message()
            blocks, size, first = [], 0, False
    if blocks or first:
        yield message()


def put_retention(message: pb.PutRequest) -> Retention:
    """The retention the first message of a Put stream asks for (InvalidRequestError if bad)."""
    return Retention(message.retention_s, message.retention_tiers or "all")


def put_batches(values: Sequence[Any], limit: int) -> list[slice]:
    """Consecutive runs of ``values`` of at most ``limit`` bytes each (a larger value alone).

    A put bigger than this goes as several Put streams: the server refuses any single request
    past its in-flight budget (``server.inflight_bytes``, at least 64 MiB)."""
    batches: list[slice] = []
    start = size = 0
    for index, value in enumerate(values):
        length = len(byte_view(value))
        if index > start and size + length > limit:
            batches.append(slice(start, index))
            start, size = index, 0
        size += length
    batches.append(slice(start, len(values)))
    return batches


def put_result(response: pb.PutResponse) -> PutResult:
    """The domain result of a Put response."""
    return PutResult(response.stored, response.already_present, response.dropped)


def get_request(namespace: bytes, keys: Sequence[bytes]) -> pb.GetRequest:
    """A Get request."""
    return pb.GetRequest(namespace=namespace, keys=list(keys))


def collect_get(responses: Iterable[pb.GetResponse], count: int) -> list[bytes | None]:
    """Payloads in request order from a Get stream (``None`` for misses)."""
    values: list[bytes | None] = [None] * count
    for response in responses:
        add_get_response(values, response)
    return values


def add_get_response(values: list[bytes | None], response: pb.GetResponse) -> None:
    """Fold one streamed Get message into ``values``."""
    for result in response.results:
        if result.found:
            values[result.index] = result.value


def fill_buffers(values: Sequence[bytes | None], buffers: Sequence[Any]) -> list[bool]:
    """Copy each found value into its buffer; a value whose size differs counts as a miss."""
    check_pairs(values, buffers, "buffers")
    views = [writable_byte_view(buffer) for buffer in buffers]
    filled = []
    for value, view in zip(values, views, strict=True):
        if value is None or len(value) != len(view):
            filled.append(False)
            continue
        view[:] = value
        filled.append(True)
    return filled


def combine_put_results(first: PutResult, second: PutResult) -> PutResult:
    """The result of a put that went partly one way and partly another."""
    return PutResult(
        first.stored + second.stored,
        first.already_present + second.already_present,
        first.dropped + second.dropped,
    )


def stats_dict(response: pb.StatsResponse) -> dict[str, Any]:
    """``{"tiers": {name: {...}}, "counters": {...}, "blocks": n}`` from a Stats response."""
    return {
        "tiers": {tier.name: dict(tier.values) for tier in response.tiers},
        "counters": dict(response.counters),
        "blocks": response.blocks,
    }


_PREFETCH_STATES = {
    pb.PREFETCH_STATE_QUEUED: PrefetchState.QUEUED,
    pb.PREFETCH_STATE_RUNNING: PrefetchState.RUNNING,
    pb.PREFETCH_STATE_DONE: PrefetchState.DONE,
    pb.PREFETCH_STATE_CANCELLED: PrefetchState.CANCELLED,
}


def prefetch_progress(response: pb.PrefetchStatusResponse) -> PrefetchProgress:
    """The domain progress of a PrefetchStatus response."""
    state = _PREFETCH_STATES.get(response.state)
    if state is None:  # a server newer than this client, or a broken one
        raise InternalStoreError(f"unknown prefetch state {response.state}")
    return PrefetchProgress(
        state, response.total, response.ready, response.missing, response.failed
    )


#: A namespace whose fields show each field's type (a declared one must match them).
_TYPES_OF = Namespace(model="m")


def key_scheme_request(namespace: Namespace, secret_check: str) -> pb.KeySchemeRequest:
    """A KeyScheme request declaring ``namespace`` (its base: per-request fields dropped)."""
    return pb.KeySchemeRequest(namespace=namespace_to_json(namespace), secret_check=secret_check)


def declared_namespace(request: pb.KeySchemeRequest) -> Namespace:
    """The base namespace a KeyScheme request declares; :class:`InvalidRequestError` (bounded,
    naming the field) for one that is too long, not JSON, or not a namespace."""
    check_key_scheme_request(request.namespace, request.secret_check)
    try:
        namespace = namespace_from_json(request.namespace, "KeySchemeRequest.namespace")
    except ConfigError as exc:  # a bad request, not a bad setting of this server
        raise InvalidRequestError(str(exc)) from exc
    for name, value in dataclasses.asdict(namespace).items():
        expected = type(getattr(_TYPES_OF, name))
        if type(value) is not expected:
            raise InvalidRequestError(
                f"KeySchemeRequest.namespace: {name} must be a JSON "
                f"{'string' if expected is str else 'integer'}"
            )
    return namespace


def key_scheme_response(scheme: KeyScheme) -> pb.KeySchemeResponse:
    """The answer to a KeyScheme request: the scheme the engine must use."""
    return pb.KeySchemeResponse(
        chunk_size=scheme.chunk_size,
        hash_algorithm=scheme.hash_algorithm,
        secret_env=scheme.secret_env,
        secret_check=scheme.secret_check,
    )


def key_scheme_result(response: pb.KeySchemeResponse, namespace: Namespace) -> KeyScheme:
    """The scheme a KeyScheme response names, for ``namespace`` (the one declared, as its base).

    A response that is no valid scheme (an algorithm this client does not know) is
    :class:`InternalStoreError`: the server answered something this client cannot use."""
    base = engine_base(namespace)
    try:
        return KeyScheme(
            base,
            int(response.chunk_size),
            response.hash_algorithm,  # type: ignore[arg-type]  # checked by KeyScheme
            response.secret_env,
            response.secret_check,
        )
    except ConfigError as exc:
        raise InternalStoreError(f"the server answered an unusable key scheme: {exc}") from exc
