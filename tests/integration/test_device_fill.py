"""``KVStoreClient.get_into_device``: blocks into device memory, and which path they took.

Real ``kvstore serve`` processes (shared memory on, or off with a UCX listener, or plain gRPC).
This machine has no GPU: the CPU tests cover host destinations on every data plane, the choice of
transports from UCX's own description of its context, and the checks on staging buffers. The
``gpu``-marked tests fill CUDA tensors on each path; they skip where no CUDA device exists.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from harness.ucx_servers import NO_SHM, UCX, kv_client, ucx_address

from kvstore.client.device_fill import (
    DEVICE_TRANSPORTS,
    checked_staging,
    copy_to_devices,
    device_byte_views,
    device_transports_in,
)
from kvstore.errors import InvalidRequestError

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

# The shape of one stored chunk in a small engine: [layers, 2, block, heads, head] in bf16.
CHUNK_SHAPE = (2, 2, 16, 2, 64)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# What UCX 1.21 prints for a context on a machine with a GPU (abridged): cuda_copy's memory
# domain is "cuda_cpy", its transport "cuda_copy"; the rest is host-only.
GPU_CONTEXT = """\
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  cuda_cpy
#     component 3  :  cuda_ipc
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 2  dev 2  flags -- cuda_copy/cuda
#      resource 3  :  md 3  dev 3  flags -- cuda_ipc/cuda
"""


@pytest.fixture(scope="module")
def data_plane() -> str:
    """One pass: every client here names its data plane itself (see test_ucx.py)."""
    return "ucx"


def _keys(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def _chunks(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(CHUNK_SHAPE, generator=generator).to(torch.bfloat16) for _ in range(count)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16)))


def _server(factory: ServerFactory, path: str) -> tuple[ServerProcess, str]:
    """A server for ``path`` (``shm``, ``ucx`` or ``grpc``) and the data plane to ask for."""
    if path == "ucx":
        return factory(*NO_SHM, *UCX), "auto"  # no shared memory: auto takes UCX
    return factory(), "grpc" if path == "grpc" else "auto"


def _fill(
    server: ServerProcess, plane: str, device: str, **call: object
) -> tuple[list[bool], str, list[torch.Tensor], list[torch.Tensor]]:
    """Put three chunks, read them back into tensors on ``device`` plus one missing key."""
    keys, chunks = _keys(3), _chunks(3, seed=len(plane))
    with kv_client(server, plane) as client:
        client.put(keys, chunks)
        tensors = [torch.zeros(CHUNK_SHAPE, dtype=torch.bfloat16, device=device) for _ in range(4)]
        result = client.get_into_device([*keys, os.urandom(16)], tensors, **call)  # type: ignore[arg-type]
    return result.found, result.path, chunks, tensors


# -- CPU -----------------------------------------------------------------------------------------


def test_device_transports_come_from_ucx_s_description_of_its_context() -> None:
    assert device_transports_in(GPU_CONTEXT) == ("cuda_copy", "cuda_ipc")
    assert device_transports_in("#  resource 1  :  md 1  dev 1  flags -- tcp/eth0") == ()
    assert device_transports_in("") == ()
    assert set(DEVICE_TRANSPORTS) >= {"cuda_copy", "cuda_ipc", "gdr_copy"}


def test_this_process_reports_no_device_transport_without_a_gpu(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(*NO_SHM, *UCX)
    assert ucx_address(server)
    with kv_client(server, "ucx") as client:
        client.put(_keys(1), _chunks(1, seed=1))  # opens the UCX path
        ucx = client._ucx
        assert ucx is not None and client.data_plane == "ucx"
        found = ucx.device_transports()
    assert set(found) <= set(DEVICE_TRANSPORTS)
    if not torch.cuda.is_available():
        assert found == ()  # UCX here is built with CUDA support; there is no driver or device


@pytest.mark.parametrize("path", ["shm", "ucx", "grpc"])
def test_host_tensors_take_the_host_path_on_every_data_plane(
    server_factory: ServerFactory, path: str
) -> None:
    server, plane = _server(server_factory, path)
    found, taken, chunks, tensors = _fill(server, plane, "cpu")
    assert (found, taken) == ([True, True, True, False], "host")
    assert all(_same(c, t) for c, t in zip(chunks, tensors, strict=False))
    assert not tensors[3].any()


def test_staging_buffers_are_checked_before_anything_moves() -> None:
    tensors = [torch.zeros(4, 8, dtype=torch.bfloat16)]
    with pytest.raises(InvalidRequestError, match="1 staging buffers for 2 tensors"):
        checked_staging([torch.zeros(64, dtype=torch.uint8)], tensors * 2)
    with pytest.raises(InvalidRequestError, match="holds 32 bytes, its tensor 64"):
        checked_staging([torch.zeros(32, dtype=torch.uint8)], tensors)
    assert len(checked_staging([torch.zeros(64, dtype=torch.uint8)], tensors)) == 1
    with pytest.raises(InvalidRequestError, match=r"tensors\[0\] must be contiguous"):
        device_byte_views([torch.zeros(4, 8).t()])


def test_copy_to_devices_copies_found_blocks_only_through_byte_views() -> None:
    sources = [torch.arange(64, dtype=torch.uint8), torch.full((64,), 7, dtype=torch.uint8)]
    targets = [torch.zeros(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    copy_to_devices(sources, device_byte_views(targets), [True, False])
    assert torch.equal(targets[0].view(torch.uint8).reshape(-1), sources[0])
    assert not targets[1].any()


# -- GPU -------------------------------------------------------------------------------------------


# The paths a CUDA fill may take per data plane: over shared memory, DMA straight from the arena
# once this client's mapping of it is page-locked (the first call starts that), else pinned
# staging; over UCX, straight into device memory where UCX reaches it here, else pinned staging.
EXPECTED_PATHS = {
    "shm": {"shm-pinned", "shm-dma"},
    "ucx": {"ucx-device", "ucx-pinned"},
    "grpc": {"grpc-pinned"},
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["shm", "ucx", "grpc"])
def test_cuda_tensors_are_filled_bit_identical_on_every_path(
    server_factory: ServerFactory, path: str
) -> None:
    server, plane = _server(server_factory, path)
    found, taken, chunks, tensors = _fill(server, plane, "cuda")
    assert found == [True, True, True, False]
    assert taken in EXPECTED_PATHS[path], taken
    assert all(_same(c, t) for c, t in zip(chunks, tensors, strict=False))
    assert not tensors[3].any()


@pytest.mark.gpu
@needs_cuda
def test_ucx_receives_into_device_memory_where_ucx_reaches_it(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(*NO_SHM, *UCX)
    with kv_client(server, "auto") as client:
        client.put(_keys(1), _chunks(1, seed=2))
        ucx = client._ucx
        assert ucx is not None
        direct = bool(ucx.device_transports())
    _, taken, _, _ = _fill(server, "auto", "cuda")
    assert taken == ("ucx-device" if direct else "ucx-pinned")


@pytest.mark.gpu
@needs_cuda
def test_over_shared_memory_cuda_tensors_are_dmaed_straight_from_the_page_locked_arena(
    server_factory: ServerFactory,
) -> None:
    server, plane = _server(server_factory, "shm")
    keys, chunks = _keys(3), _chunks(3, seed=5)
    with kv_client(server, plane) as client:
        client.put(keys, chunks)
        client.register_arena_with()  # the CUDA runtime's registrar
        assert client.open_data_plane() == "shm"
        shm = client._shm.plane
        registration = None if shm is None else shm.registration
        assert registration is not None
        assert registration.wait_covered(registration.base, registration.size, 120), (
            registration.stats()
        )
        tensors = [torch.zeros(CHUNK_SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        result = client.get_into_device([*keys, os.urandom(16)], tensors)
    assert result.path == "shm-dma" and result.found == [True, True, True, False]
    assert all(_same(c, t) for c, t in zip(chunks, tensors, strict=False))
    assert not tensors[3].any()


@pytest.mark.gpu
@needs_cuda
def test_a_caller_s_pinned_staging_is_used(
    server_factory: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_SHM_CUDA_REGISTER", "off")  # else a later call takes shm-dma
    server, plane = _server(server_factory, "shm")
    staging = [torch.empty(CHUNK_SHAPE, dtype=torch.bfloat16, pin_memory=True) for _ in range(4)]
    found, taken, chunks, tensors = _fill(server, plane, "cuda", staging=staging)
    assert taken == "shm-pinned" and found == [True, True, True, False]
    assert all(_same(c, s) for c, s in zip(chunks, staging, strict=False))
    assert all(_same(c, t) for c, t in zip(chunks, tensors, strict=False))
    assert np.count_nonzero(tensors[3].cpu().view(torch.int16).numpy()) == 0
