"""What a test of code that uses a kvstore client needs, with no server: shipped, so a user's
tests and kvstore's own use the same.

    MockTransport   a client's transport answered by a function, ``handler(method, request)``
    MockRpcError    what :meth:`MockTransport.error` makes for a handler to raise (a gRPC status)
    pb              the request and response messages a handler reads and returns
    MemoryStore     a handler that keeps blocks in a dict and answers as ``kvstore serve`` does

A test drives the real client (its requests, batches, deadlines and error mapping)::

    from kvstore import KVStoreClient, Namespace
    from kvstore.testing import MemoryStore, MockTransport

    store = MemoryStore()
    transport = MockTransport(store)
    with KVStoreClient("unused", namespace=Namespace(model="m"), transport=transport) as client:
        client.put([bytes(16)], [b"block"])
        assert client.lookup([bytes(16)]) == 1
    assert store.methods() == ["Put", "Lookup"]

``MemoryStore`` keeps blocks in a dict keyed by (namespace, key), every stored block in ``dram``.
It answers the wire as ``kvstore serve`` does where tests look (leading hits, missing keys, a
namespace's own blocks only, prefetch states); it checks nothing a server would refuse.
``calls`` records each call's method and request; ``fail`` makes every call fail with a status
until it is cleared. Importing this module loads the client side only, never the server's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore.client.mock_transport import Handler, MockRpcError, MockTransport, pb

__all__ = ["Handler", "MemoryStore", "MockRpcError", "MockTransport", "pb"]


@dataclass
class _Prefetch:
    keys: int
    #: Status polls left before the prefetch is DONE (it is RUNNING meanwhile).
    polls_left: int
    cancelled: bool = False


@dataclass
class MemoryStore:
    """A handler for :class:`MockTransport` holding blocks in a dict (see the module)."""

    #: (namespace, key) -> value.
    blocks: dict[tuple[bytes, bytes], bytes] = field(default_factory=dict)
    #: (method, request) of every call, in order.
    calls: list[tuple[str, Any]] = field(default_factory=list)
    #: Fail every call with this status (and message) while set.
    fail: tuple[grpc.StatusCode, str] | None = None
    #: How many status polls a prefetch stays RUNNING before it is DONE.
    prefetch_polls: int = 2
    #: What ``KeyScheme`` answers (the node's ``keys.chunk_size``).
    chunk_size: int = 256
    _prefetches: dict[int, _Prefetch] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def methods(self) -> list[str]:
        """The methods called so far, in order."""
        return [method for method, _ in self.calls]

    def __call__(self, method: str, request: Any) -> Any:
        with self._lock:
            self.calls.append((method, request))
            if self.fail is not None:
                raise MockTransport.error(*self.fail)
            answer = self._answers().get(method)
            if answer is None:
                raise MockTransport.error(grpc.StatusCode.UNIMPLEMENTED, f"no {method} here")
            return answer(request)

    def _answers(self) -> dict[str, Any]:
        return {
            "Lookup": self._lookup,
            "Put": self._put,
            "Get": self._get,
            "Delete": self._delete,
            "Stats": self._stats,
            "Prefetch": self._prefetch,
            "PrefetchStatus": self._prefetch_status,
            "CancelPrefetch": self._cancel_prefetch,
            "KeyScheme": self._key_scheme,
        }

    def _key_scheme(self, request: pb.KeySchemeRequest) -> pb.KeySchemeResponse:
        """A node on the default ``[keys]`` settings, taking the engine's secret as its own."""
        return pb.KeySchemeResponse(
            chunk_size=self.chunk_size,
            hash_algorithm="xxh3_128",
            secret_env="KVSTORE_HASH_SECRET",
            secret_check=request.secret_check,
        )

    def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        tiers = ["dram" if (request.namespace, k) in self.blocks else "" for k in request.keys]
        hits = next((i for i, tier in enumerate(tiers) if not tier), len(tiers))
        return pb.LookupResponse(hits=hits, tiers=tiers)

    def _put(self, requests: list[pb.PutRequest]) -> pb.PutResponse:
        namespace = requests[0].namespace  # only the stream's first message carries it
        stored = present = 0
        for message in requests:
            for block in message.blocks:
                if (namespace, block.key) in self.blocks:
                    present += 1
                else:
                    self.blocks[namespace, block.key] = block.value
                    stored += 1
        return pb.PutResponse(stored=stored, already_present=present)

    def _get(self, request: pb.GetRequest) -> list[pb.GetResponse]:
        # One message per block: a stream of several, as a server sends for a large batch.
        messages = []
        for index, key in enumerate(request.keys):
            value = self.blocks.get((request.namespace, key))
            result = pb.GetResult(index=index, found=value is not None, value=value or b"")
            messages.append(pb.GetResponse(results=[result]))
        return messages

    def _delete(self, request: pb.DeleteRequest) -> pb.DeleteResponse:
        gone = [self.blocks.pop((request.namespace, k), None) for k in request.keys]
        return pb.DeleteResponse(deleted=sum(value is not None for value in gone))

    def _stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        used = sum(len(value) for value in self.blocks.values())
        dram = pb.TierStats(name="dram", values={"used_bytes": used})
        return pb.StatsResponse(tiers=[dram], blocks=len(self.blocks))

    def _prefetch(self, request: pb.PrefetchRequest) -> pb.PrefetchResponse:
        prefetch_id = len(self._prefetches) + 1
        self._prefetches[prefetch_id] = _Prefetch(len(request.keys), self.prefetch_polls)
        return pb.PrefetchResponse(prefetch_id=prefetch_id)

    def _prefetch_status(self, request: pb.PrefetchStatusRequest) -> pb.PrefetchStatusResponse:
        prefetch = self._known(request.prefetch_id)
        if prefetch.cancelled:
            return pb.PrefetchStatusResponse(state=pb.PREFETCH_STATE_CANCELLED, total=prefetch.keys)
        if prefetch.polls_left > 0:
            prefetch.polls_left -= 1
            return pb.PrefetchStatusResponse(state=pb.PREFETCH_STATE_RUNNING, total=prefetch.keys)
        return pb.PrefetchStatusResponse(
            state=pb.PREFETCH_STATE_DONE, total=prefetch.keys, ready=prefetch.keys
        )

    def _cancel_prefetch(self, request: pb.CancelPrefetchRequest) -> pb.CancelPrefetchResponse:
        prefetch = self._known(request.prefetch_id)
        running = prefetch.polls_left > 0 and not prefetch.cancelled
        prefetch.cancelled = prefetch.cancelled or running
        return pb.CancelPrefetchResponse(cancelled=running)

    def _known(self, prefetch_id: int) -> _Prefetch:
        prefetch = self._prefetches.get(prefetch_id)
        if prefetch is None:
            raise MockTransport.error(grpc.StatusCode.NOT_FOUND, f"no prefetch {prefetch_id}")
        return prefetch
