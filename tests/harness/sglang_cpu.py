"""CPU STAND-INS for the pinned SGLang (0.5.23): what lets a real SGLang engine run a tiny Llama
on a machine without a GPU. None of this is kvstore code and none of it ships.

SGLang 0.5.23 is built for CUDA. On this machine it runs with ``SGLANG_USE_CPU_ENGINE=1`` (its own
CPU engine: torch-native attention, ``device="cpu"``) once four CUDA-only pieces are stood in for
and one limit is lowered:

1. ``sgl_kernel`` (the 373 MB CUDA-only ``sglang-kernel`` wheel is not installed): an import-only
   module. SGLang imports names from it at module level; a tiny Llama on the CPU engine calls
   none of them (its norms and activations take SGLang's native torch paths, since this CPU has no
   AMX), so each name is a function that raises, naming itself, if anything ever does call it.
2. torchvision's operator registrations: the torchvision wheel is a CUDA build whose ``_C``
   extension does not load against the CPU torch, and its ``_meta_registrations`` /
   ``_autograd_registrations`` modules then fail at import ("operator torchvision::nms does not
   exist"). They are replaced by empty modules; nothing here runs a torchvision operator.
3. The HiCache host pool pins its memory (``pin_memory=True``), which needs CUDA: it is built with
   ``pin_memory=False``.
4. ``--hicache-io-backend direct --hicache-mem-layout layer_first`` moves pages between the device
   pool and the host pool with ``sgl_kernel.kvcacheio.transfer_kv_direct``, which SGLang only
   imports on CUDA/ROCm: :func:`transfer_kv_direct` is a pure-torch version of it.

5. Not CUDA, but this machine: SGLang refuses a host pool unless 10 GiB of host memory would
   stay free beside it (``HICACHE_HOST_MEMORY_RESERVE_BYTES``). The test host pools are a few
   MB on a 24 GB machine that parallel tests share, so the reserve is lowered to
   :data:`HOST_RESERVE_BYTES`.

SGLang spawns its scheduler and detokenizer (``multiprocessing`` start method ``spawn``), so
:func:`install` must run at the top level of the module that launches it
(``tests/sglang_engine/launch_cpu_server.py`` does): a spawned child re-imports that module first.
``tests/sglang_engine/test_standins_guard.py`` fails, naming what changed, when a new SGLang no
longer fits these stand-ins.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "HOST_RESERVE_BYTES",
    "PINNED_SGLANG",
    "SGL_KERNEL_NAMES",
    "install",
    "transfer_kv_direct",
]

#: The SGLang release these stand-ins were written against (``scripts/setup-sglang.sh`` pins it).
PINNED_SGLANG = "0.5.23"

#: Names SGLang 0.5.23 imports from ``sgl_kernel`` at module level on the code paths the CPU
#: engine takes; the stand-in answers any other name too (an import-only module cannot know).
SGL_KERNEL_NAMES = ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "rmsnorm")

#: The host memory SGLang keeps free beside a HiCache host pool here (its own default: 10 GiB).
HOST_RESERVE_BYTES = 1 << 30

_installed = False


def _not_on_cpu(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but sgl_kernel is an import-only CPU stand-in "
            "(tests/harness/sglang_cpu.py): the CPU engine should have taken a torch path"
        )

    call.__name__ = name
    return call


class _ImportOnlyModule(types.ModuleType):
    """A module whose every attribute is a function that raises: ``from m import x`` works."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _not_on_cpu(
            f"{self.__name__.partition('.')[2] + '.' if '.' in self.__name__ else ''}{name}"
        )
        setattr(self, name, value)
        return value


def _stand_in_sgl_kernel() -> None:
    if "sgl_kernel" in sys.modules:
        return
    root = _ImportOnlyModule(
        "sgl_kernel", "CPU stand-in: import-only (tests/harness/sglang_cpu.py)"
    )
    root.__path__ = []  # a package, so ``from sgl_kernel.kvcacheio import ...`` resolves too
    setattr(root, "__version__", "0.0.0+cpu-stand-in")  # noqa: B010 (a module attribute mypy cannot see)
    sys.modules["sgl_kernel"] = root
    for sub in ("kvcacheio", "flash_attn", "allreduce"):
        module = _ImportOnlyModule(f"sgl_kernel.{sub}")
        sys.modules[module.__name__] = module
        setattr(root, sub, module)


def _skip_torchvision_registrations() -> None:
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name, "CPU stand-in: registrations skipped")


def transfer_kv_direct(
    src_layers: Sequence[Any],
    dst_layers: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Copy the token rows ``src_indices`` of each source layer to ``dst_indices`` of its
    destination (a pure-torch stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct``).

    ``page_size`` is accepted for the signature's sake: rows are copied by token index, which
    covers whole pages as well as single tokens.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destinations")
    if len(src_indices) != len(dst_indices):
        raise ValueError(f"{len(src_indices)} source rows but {len(dst_indices)} destinations")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        rows = src.index_select(0, src_indices.to(src.device, dtype=_long()))
        dst.index_copy_(0, dst_indices.to(dst.device, dtype=_long()), rows.to(dst.dtype))


def _long() -> Any:
    import torch

    return torch.int64


def _unpinned_host_pool() -> None:
    from sglang.srt.mem_cache.pool_host import base

    init = base.HostKVCache.__init__
    if getattr(init, "_kvstore_cpu_stand_in", False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        init(*bound.args, **bound.kwargs)

    unpinned._kvstore_cpu_stand_in = True  # type: ignore[attr-defined]
    base.HostKVCache.__init__ = unpinned  # type: ignore[method-assign, unused-ignore]
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = HOST_RESERVE_BYTES


def _direct_transfer() -> None:
    from sglang.srt.mem_cache.pool_host import mha

    mha.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined, unused-ignore]


def install() -> None:
    """Put every stand-in in place in this process (idempotent); call it before SGLang loads."""
    global _installed
    if _installed:
        return
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    _stand_in_sgl_kernel()
    _skip_torchvision_registrations()
    _unpinned_host_pool()
    _direct_transfer()
    _installed = True
