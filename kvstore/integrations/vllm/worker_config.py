"""What the worker half reads from vLLM's configuration: a group's cache spec, a layer's
attention backend, the worker's ranks. Duck-typed, so it is tested without vLLM."""

from __future__ import annotations

import logging
import os
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


def sink_split_warning(vllm_config: VllmConfig, layer_names: list[str]) -> str | None:
    """The warning for vLLM's CPU attention dropping sliding layers' sinks, if it applies.

    With the hybrid KV cache manager off, sliding-window and full-attention layers share one
    group, so vLLM's CPU attention plans a decode token's KV splits over threads as if there
    were no window; it applies attention sinks on the first split only, which for a sliding
    layer lies outside the window: outputs differ (gpt-oss). It happens without any connector
    too, but a configured connector changes vLLM's CPU thread count, which can start it. One
    thread or ``VLLM_CPU_ATTN_SPLIT_KV=0`` avoids the split; the manager on (kvstore supports
    it) gives sliding layers their own plan.
    """
    if str(getattr(getattr(vllm_config, "device_config", None), "device_type", "")) != "cpu":
        return None
    if os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") == "0":
        return None
    layers = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    windows, sinks = set(), False
    for name in layer_names:
        impl = getattr((layers or {}).get(name), "impl", None)
        windows.add(getattr(impl, "sliding_window", None))
        sinks = sinks or getattr(impl, "sinks", None) is not None
    if not sinks or len(windows) < 2:
        return None
    return (
        "kvstore: this model's sliding-window layers have attention sinks and share one KV "
        "cache group with full-attention layers (the hybrid KV cache manager is off): vLLM's "
        "CPU attention then applies the sinks of a sliding layer on a KV split outside its "
        "window, and outputs differ (vLLM cpu_attn_impl.hpp, use_sink on split 0). Keep the "
        "hybrid KV cache manager on (kvstore supports it) or set VLLM_CPU_ATTN_SPLIT_KV=0"
    )
