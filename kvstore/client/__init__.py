"""The client side: what an engine process loads to talk to ``kvstore serve``.

:class:`KVStoreClient` and :class:`AsyncKVStoreClient` are the public clients; the shared-memory
(:mod:`kvstore.client.shm`) and UCX (:mod:`kvstore.client.ucx`) halves of the data planes live
beside them. A client's calls go through a transport (:mod:`kvstore.client.transport`), a gRPC
channel unless one is given: :class:`MockTransport` answers from a function, for tests of code
that uses a client. Nothing here imports the store, a tier, the server, LMDB or Redis.
"""

from kvstore.client.aio import AsyncKVStoreClient
from kvstore.client.mock_transport import MockTransport
from kvstore.client.settings import ClientSettings
from kvstore.client.sync import KVStoreClient
from kvstore.client.transport import AsyncTransport, Transport

__all__ = [
    "AsyncKVStoreClient",
    "AsyncTransport",
    "ClientSettings",
    "KVStoreClient",
    "MockTransport",
    "Transport",
]
