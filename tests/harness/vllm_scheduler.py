"""STAND-INS for vLLM's scheduler-side objects, for the tests that drive the connector's halves
without vLLM (``tests/integrations/``, the GPU harness) or beside a real engine
(``tests/vllm_engine/``).

Each is a plain object carrying only the fields the connector reads -- written once, here, so
that a field the connector starts to read is added in one place:

* :func:`stand_in_request` for ``vllm.v1.request.Request``;
* :class:`StandInBlocks` for ``KVCacheBlocks`` (what ``update_state_after_alloc`` is given);
* :class:`StandInManager` for ``KVCacheManager`` (the request's block ids, set by the test);
* :func:`stand_in_output` for ``SchedulerOutput`` (new and running requests, none preempted).

None of them is vLLM's: a test that passes here says nothing of a field vLLM renames. The real
engines' suite (``tests/vllm_engine/``) is what catches that.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

__all__ = ["StandInBlocks", "StandInManager", "stand_in_output", "stand_in_request"]


def stand_in_request(req_id: str, tokens: list[int], **fields: Any) -> Any:
    """Stands in for ``vllm.v1.request.Request``: a text prompt of ``tokens``, no multimodal
    features, embeddings, LoRA or salt unless ``fields`` set them (``cache_salt="s"``, say)."""
    return SimpleNamespace(
        **{
            "request_id": req_id,
            "prompt_token_ids": tokens,
            "mm_features": [],
            "prompt_embeds": None,
            "lora_request": None,
            "cache_salt": None,
            **fields,
        }
    )


class StandInBlocks:
    """Stands in for ``KVCacheBlocks``: one KV cache group's block ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        """The ids, as vLLM gives them: one list per KV cache group."""
        return (self.ids,)


class StandInManager:
    """Stands in for ``KVCacheManager``: the block ids each request holds, as the test sets them
    in :attr:`blocks`."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        """``req_id``'s block ids: one list per KV cache group."""
        return (self.blocks[req_id],)


def stand_in_output(
    new: Sequence[tuple[str, int, int]], cached: Sequence[tuple[str, int, int]] = ()
) -> Any:
    """Stands in for ``SchedulerOutput``: new and running (``cached``) requests ``(req_id,
    num_computed, num_scheduled)``, none preempted or finished."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached]
        ),
        num_scheduled_tokens={r: n for r, _, n in [*new, *cached]},
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )
