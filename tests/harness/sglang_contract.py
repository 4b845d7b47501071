"""The contract tier's parts: SGLang's real host pools over CPU device pools, its storage
config, its storage factory making the kvstore backend, page hashes like SGLang's.

Nothing here imports SGLang until called (``tests/sglang_engine/conftest.py`` imports this module
where SGLang may be missing, and installs the CPU stand-ins before anything here runs).
"""

from __future__ import annotations

import hashlib
from typing import Any

#: The contract tier's page size, and so its stores' keys.chunk_size.
PAGE_SIZE = 16
#: The host memory the tier's host pools are booked against (SGLang's own budget scope).
HOST_BUDGET_BYTES = 64 << 20


def host_pool(
    layout: str,
    *,
    mla: bool = False,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 8,
    tokens: int = 512,
    dtype: Any = None,
    seed: int = 0,
    page_size: int = PAGE_SIZE,
) -> Any:
    """SGLang's real host pool (``MHATokenToKVPoolHost``, or ``MLATokenToKVPoolHost``) over a
    CPU device pool, as HiCache builds it, with random bits in every page."""
    import torch
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    dtype = dtype or torch.bfloat16
    common = {"start_layer": 0, "end_layer": layers}
    # SGLang refuses a host pool when the machine has less than 10 GiB free beyond it (a shared
    # test machine often has not); these pools are a few hundred KiB: book them against a budget.
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        pool = _pool(mla, layout, layers, heads, head_dim, tokens, dtype, page_size, common)
    generator = torch.Generator().manual_seed(seed)
    bits = pool.kv_buffer.view(torch.uint8)
    bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=generator))
    return pool


def _pool(
    mla: bool,
    layout: str,
    layers: int,
    heads: int,
    head_dim: int,
    tokens: int,
    dtype: Any,
    page_size: int,
    common: dict[str, int],
) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if mla:
        device: Any = MLATokenToKVPool(
            tokens, page_size, dtype, head_dim - 2, 2, layers, "cpu", False, **common
        )
        host, extra = MLATokenToKVPoolHost, {"target_layer_num": layers}
    else:
        device = MHATokenToKVPool(
            tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, **common
        )
        host, extra = MHATokenToKVPoolHost, {}
    # The host pools take the same arguments (the MLA one also how many layers it serves).
    pool = host(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,  # host-to-device size ratio
        0,  # host size override (0: by the ratio)
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        **extra,
        **common,
    )
    return pool


def storage_config(
    target: str,
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "tiny-llama",
    layout: str = "layer_first",
    **extra: Any,
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for the kvstore backend at ``target`` (``extra``: more
    keys of ``--hicache-storage-backend-extra-config``)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first",
        model_name=model,
        extra_config={**BACKEND, "target": target, **GENEROUS, **extra},
    )


#: Deadlines for the tests that are not about deadlines: on 2 cores at load 10 a call on a healthy
#: store can take a second; a deadline missed there would be a miss, not the failure under test.
GENEROUS = {"timeout_s": 20.0, "lookup_timeout_s": 10.0}

#: The extra config that names the backend (``docs/sglang.md``'s command line).
BACKEND = {
    "backend_name": "kvstore",
    "module_path": "kvstore.integrations.sglang",
    "class_name": "KVStoreHiCacheStorage",
    "interface_v1": 1,
}


def open_backend(config: Any, pool: Any) -> Any:
    """The backend as SGLang's cache controller makes it: through the storage factory's
    ``dynamic`` backend (which wraps it in SGLang's failure injector where the test environment
    variables ask), then given its host pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    try:
        backend.register_mem_pool_host(pool)
    except BaseException:
        backend.close()
        raise
    return backend


def page_indices(pool: Any, pages: int) -> Any:
    """Host indices of ``pages`` fresh pages of ``pool``, from its own allocator."""
    indices = pool.alloc(pages * pool.page_size)
    assert indices is not None, "the host pool is full"
    return indices


def hashes(tag: str, count: int) -> list[str]:
    """``count`` SGLang-style page hashes (SHA-256 hex digests) of a chain named ``tag``."""
    chain, out = b"", []
    for i in range(count):
        chain = hashlib.sha256(chain + f"{tag}/{i}".encode()).digest()
        out.append(chain.hex())
    return out
