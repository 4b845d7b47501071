"""Real ``kvstore serve --ucx-listen`` servers over loopback and the clients of their UCX path.

The flags that turn the listener on (:data:`UCX`) and shared memory off (:data:`NO_SHM`), the
address a server advertises in ``DataPlane``, the two kinds of client (a :class:`KVStoreClient`
naming its data plane, a :class:`UcxDataClient` on a gRPC client's channel), random keys and
values, and the module-scoped server with its address and gRPC client as fixtures.

Importing this module needs ``ucxx`` (the ``ucx`` extra). Without it the import fails, loudly,
unless ``KVSTORE_SKIP_UCX=1`` says that this environment is not meant to have UCX (then the
importing test module is skipped): a missing dependency must not turn into a quietly skipped
suite.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest

from harness.ucx_guard import require_ucx
from kvstore import KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol.messages import namespace_bytes

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

require_ucx()

from kvstore.client.ucx import UcxDataClient  # noqa: E402

__all__ = [
    "NAMESPACE",
    "NO_SHM",
    "UCX",
    "address",
    "keys_of",
    "kv",
    "kv_client",
    "ucx_address",
    "ucx_client",
    "ucx_server",
    "values_of",
]

NAMESPACE = Namespace(model="ucx-test", num_layers=2, num_kv_heads=2, head_size=64)
# The UCX listener binds every interface: an unauthenticated server must say it allows that.
UCX = ("--ucx-listen", "127.0.0.1:0", "--allow-unauthenticated")
NO_SHM = ("--shm-socket", "")


def ucx_address(server: ServerProcess) -> str:
    """The UCX listener the server advertises in ``DataPlane`` ("" when it has none)."""
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=10.0)
    return str(response.ucx_address)


def kv_client(
    server: ServerProcess,
    data_plane: str,
    namespace: Namespace = NAMESPACE,
    timeout: float = 10.0,
) -> KVStoreClient:
    """A client of ``server`` on the data plane it names (``"ucx"``, ``"auto"``, ``"grpc"``)."""
    return KVStoreClient(server.target, namespace=namespace, timeout=timeout, data_plane=data_plane)


def ucx_client(
    kv: KVStoreClient, address: str, namespace: Namespace = NAMESPACE, **kwargs: Any
) -> UcxDataClient:
    """A :class:`UcxDataClient` whose control calls use ``kv``'s channel (its gRPC transport's)."""
    channel = kv._transport.channel  # type: ignore[attr-defined]
    return UcxDataClient(channel, address, namespace_bytes(namespace), **kwargs)


def keys_of(count: int) -> list[bytes]:
    """``count`` random 16-byte keys."""
    return [os.urandom(16) for _ in range(count)]


def values_of(sizes: list[int], seed: int = 0) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    """Random byte arrays of ``sizes``, the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


@pytest.fixture(scope="module")
def ucx_server(module_server_factory: ServerFactory) -> Iterator[ServerProcess]:
    """The module's server: UCX listener on, shared memory on (the default)."""
    server = module_server_factory(*UCX, dram_capacity="256MiB", nvme_capacity="256MiB")
    yield server
    if server.running:
        server.stop()


@pytest.fixture(scope="module")
def address(ucx_server: ServerProcess) -> str:
    """The UCX address the module's server advertises (on loopback)."""
    advertised = ucx_address(ucx_server)
    assert advertised.startswith("127.0.0.1:"), ucx_server.stderr()
    return advertised


@pytest.fixture
def kv(ucx_server: ServerProcess) -> Iterator[KVStoreClient]:
    """A gRPC-only client: the control channel of ``ucx``, and the reference path."""
    with kv_client(ucx_server, "grpc") as client:
        yield client
