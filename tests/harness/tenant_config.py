"""Two tenants of a real ``kvstore serve`` and the callers that act as them.

A TOML file (``[tenants.NAME]``) names, for each tenant, the token names that act as it and the
local users whose engines may map its arena; the tokens file holds the real tokens' hashes. The
tests then call with those real tokens: alice is tenant a, bob tenant b, carol in no tenant.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvstore import BlockKey, ChunkHasher, KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from harness.serve import ServerProcess

__all__ = [
    "BLOCK_BYTES",
    "NOBODY",
    "NOGROUP",
    "NS",
    "OTHER_NS",
    "TOKENS",
    "blocks",
    "client",
    "data_plane_of",
    "write_config",
]

NS = Namespace(model="tenants", num_layers=2, num_kv_heads=2, head_size=64)
OTHER_NS = Namespace(model="tenants-other", num_layers=2, num_kv_heads=2, head_size=64)
#: Token name -> the token itself; the tokens file holds their hashes.
TOKENS = {"alice": "token-of-alice", "bob": "token-of-bob", "carol": "token-of-carol"}
NOBODY = 65534
NOGROUP = 65534  # nobody's primary group on Debian
BLOCK_BYTES = 64 * 1024


def blocks(seed: int, count: int = 4) -> tuple[list[BlockKey], list[bytes]]:
    """``count`` chained keys of :data:`NS` and random values of :data:`BLOCK_BYTES`."""
    keys = ChunkHasher(chunk_size=16, namespace=NS).keys(list(range(16 * count)))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


def write_config(
    tmp_path: Path,
    extra: str = "",
    b_uids: str = f"[0, {NOBODY}]",
    a_uids: str = "[0]",
    shm: str = "true",
) -> Path:
    """Tokens for alice, bob and carol; tenant a is alice (local users ``a_uids``: root), tenant
    b is bob (``b_uids``); carol is in no tenant. Both tenants' engines share their arenas over
    shared memory unless ``shm`` is "false"."""
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "".join(f"{name} {hashlib.sha256(t.encode()).hexdigest()}\n" for name, t in TOKENS.items())
    )
    config = tmp_path / "tenants.toml"
    config.write_text(
        f'[auth]\ntokens_file = "{tokens}"\n[shm]\nsocket_mode = 0o666\n{extra}\n'
        f'[tenants.a]\nidentities = ["alice"]\nuids = {a_uids}\ndram = "16MiB"\nnvme = "16MiB"\n'
        f"shm = {shm}\n"
        f'[tenants.b]\nidentities = ["bob"]\nuids = {b_uids}\ndram = "16MiB"\nnvme = "16MiB"\n'
        f"shm = {shm}\n"
    )
    return config


def client(server: ServerProcess, who: str, **kwargs: Any) -> KVStoreClient:
    """A client of :data:`NS` calling with ``who``'s token."""
    return KVStoreClient(server.target, namespace=NS, token=TOKENS[who], **kwargs)


def data_plane_of(server: ServerProcess, who: str) -> pb.DataPlaneResponse:
    """The server's ``DataPlane`` answer to ``who`` (what it offers that caller)."""
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        metadata = [("authorization", f"Bearer {TOKENS[who]}")]
        response: pb.DataPlaneResponse = stub.DataPlane(
            pb.DataPlaneRequest(), timeout=10, metadata=metadata
        )
        return response
