"""What the worker half reads from vLLM's configuration: a group's cache spec, a layer's
attention backend, the worker's ranks. Duck-typed, so it is tested without vLLM."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvstore.integrations.paged.kv_layout import CacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def _cache_spec(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, group: int = 0
) -> CacheSpec:
    """What the engine's configuration says one layer's cache of ``group`` holds."""
    spec: Any = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    head_size = int(spec.head_size)
    head_size_v = getattr(spec, "head_size_v", None)
    return CacheSpec(
        num_blocks=int(kv_cache_config.num_blocks),
        block_size=int(spec.block_size),
        # vLLM >= 0.2x may pack heads differently (num_head_slots); else one slot per KV head.
        num_kv_heads=int(getattr(spec, "num_head_slots", None) or spec.num_kv_heads),
        head_size=head_size,
        head_size_v=head_size if head_size_v is None else int(head_size_v),
        mla=bool(getattr(vllm_config.model_config, "use_mla", False)),
    )


def _backend_name(vllm_config: VllmConfig, layer_name: str) -> str | None:
    """The attention backend of ``layer_name`` as vLLM names it, or ``None`` if not exposed."""
    compilation = getattr(vllm_config, "compilation_config", None)
    layers = getattr(compilation, "static_forward_context", None) or {}
    layer = layers.get(layer_name)
    get_backend = getattr(layer, "get_attn_backend", None)
    if get_backend is None:
        return None
    try:
        return str(get_backend().get_name())
    except Exception as exc:  # only narrows what is accepted: a 4-D cache needs no name
        logger.warning("cannot tell the attention backend of %s: %s", layer_name, exc)
        return None


def _ranks(vllm_config: VllmConfig) -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1 and parallel.pipeline_parallel_size == 1:
        return 0, 0
    # With several ranks a wrong rank would make ranks share keys (silent corruption), so a
    # failure here must stop the engine rather than fall back to 0.
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
