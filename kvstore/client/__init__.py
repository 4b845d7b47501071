"""The client side: what an engine process loads to talk to ``kvstore serve``.

:class:`KVStoreClient` and :class:`AsyncKVStoreClient` are the public clients; the shared-memory
(:mod:`kvstore.client.shm`) and UCX (:mod:`kvstore.client.ucx`) halves of the data planes live
beside them. Nothing here imports the store, a tier, the server, LMDB or Redis.
"""

from kvstore.client.aio import AsyncKVStoreClient
from kvstore.client.settings import ClientSettings
from kvstore.client.sync import KVStoreClient

__all__ = ["AsyncKVStoreClient", "ClientSettings", "KVStoreClient"]
