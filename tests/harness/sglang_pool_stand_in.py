"""A stand-in for SGLang's host KV pools, for the tests that run without SGLang.

It has the attributes the backend reads (``layout``, ``layer_num``, ``page_size``, ``dtype``,
``kv_buffer``, ...) and allocates ``kv_buffer`` with the dimensions SGLang 0.5.23's
``MHATokenToKVPoolHost.init_kv_buffer`` and ``MLATokenToKVPoolHost.init_kv_buffer`` use;
:meth:`HostPoolStandIn.data_page` is their ``get_data_page(index, flat=True)``. The contract tier
(``tests/sglang_engine/test_contract*.py``) checks the backend against SGLang's real pools, so a
drift of this stand-in from SGLang shows there.
"""

from __future__ import annotations

import torch


class HostPoolStandIn:
    """An MHA (``mla=False``) or MLA host pool of ``pages`` pages, filled with random bytes."""

    def __init__(
        self,
        layout: str,
        *,
        mla: bool = False,
        layers: int = 3,
        page_size: int = 4,
        heads: int = 2,
        head_dim: int = 8,
        pages: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        self.layout = layout
        self.layer_num = layers
        self.page_size = page_size
        self.dtype = dtype
        self.page_num = pages
        self.size = pages * page_size
        self.start_layer = 0
        self.dcp_size = 1
        size, P, L = self.size, page_size, layers
        if mla:
            self.kv_lora_rank = head_dim - 2
            self.qk_rope_head_dim = 2
            self.kv_cache_dim = head_dim
            dims = {
                "layer_first": (L, size, 1, head_dim),
                "page_first": (size, L, 1, head_dim),
                "page_first_direct": (pages, L, P, 1, head_dim),
            }
        else:
            self.head_num = heads
            self.head_dim = head_dim
            self.v_head_dim = head_dim
            dims = {
                "layer_first": (2, L, size, heads, head_dim),
                "page_first": (2, size, L, heads, head_dim),
                "page_first_direct": (2, pages, L, P, heads, head_dim),
            }
        self.mla = mla
        shape = dims.get(layout, (1,))
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
        self.kv_buffer = raw.view(dtype) if dtype.itemsize == 2 else raw.to(dtype)

    def data_page(self, index: int) -> torch.Tensor:
        """SGLang's ``get_data_page(index, flat=True)``: the page at token ``index``, flat."""
        kv, P = self.kv_buffer, self.page_size
        if self.mla:
            if self.layout == "layer_first":
                page = kv[:, index : index + P]
            elif self.layout == "page_first":
                page = kv[index : index + P]
            else:
                page = kv[index // P : index // P + 1]
        elif self.layout == "layer_first":
            page = kv[:, :, index : index + P]
        elif self.layout == "page_first":
            page = kv[:, index : index + P]
        else:
            page = kv[:, index // P : index // P + 1]
        return page.flatten()

    def indices(self, pages: list[int]) -> torch.Tensor:
        """Host token indices of ``pages`` (what SGLang passes to the zero-copy calls)."""
        P = self.page_size
        rows = [torch.arange(p * P, (p + 1) * P, dtype=torch.int64) for p in pages]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)

    def wipe(self) -> None:
        """Zero the whole pool (a restarted engine's empty host cache)."""
        self.kv_buffer.zero_()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes in the same shape (random bits hold NaNs, which
    ``torch.equal`` calls different from themselves)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
