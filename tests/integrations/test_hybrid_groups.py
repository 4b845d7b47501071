"""The hit rule per KV cache group kind, group keys, and the per-group load and save plans.

Engine-free: groups are :class:`~kvstore.integrations.paged.groups.GroupSpec` values and block
tables plain lists (vLLM's own objects drive the same code in tests/vllm_engine/test_hma_groups.py).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvstore.integrations.paged.groups import (
    GroupSpec,
    anchor_group,
    group_keys,
    groups_fingerprint,
    longest_hit,
    needed_chunks,
)
from kvstore.integrations.vllm.hybrid import GroupLayout, scheme_block_size
from kvstore.integrations.vllm.worker_config import sink_split_warning
from kvstore.retention import KEEP
from kvstore.types import LookupResult

CHUNK = 32
BLOCK = 16
NULL = 0


def _group(index: int, kind: str, window: int = 0, block: int = BLOCK) -> GroupSpec:
    return GroupSpec(index, kind, block, window, (f"l{index}",), 1024, "test")


FULL = _group(0, "full")
SLIDING = _group(1, "sliding", window=40)  # reads the 39 tokens before the next one
LOCAL = _group(2, "local", window=64)  # chunked local attention, attention chunks of 64


def test_needed_chunks_per_kind() -> None:
    assert needed_chunks(FULL, 6, CHUNK) == range(0, 6)
    # Token 192's window is tokens 153..191: chunks 4 and 5.
    assert needed_chunks(SLIDING, 6, CHUNK) == range(4, 6)
    # A boundary inside the first window needs every chunk before it.
    assert needed_chunks(SLIDING, 1, CHUNK) == range(0, 1)
    # Token 192 starts attention chunk 3 (tokens 192..255): nothing before it is read ...
    assert needed_chunks(LOCAL, 6, CHUNK) == range(6, 6)
    # ... token 160 is in attention chunk 2 (128..191): chunk 4 only.
    assert needed_chunks(LOCAL, 5, CHUNK) == range(4, 5)
    assert needed_chunks(FULL, 0, CHUNK) == range(0)


def test_the_hit_is_the_longest_prefix_every_group_can_serve() -> None:
    groups = [FULL, SLIDING]
    everything = [True] * 6
    assert longest_hit(groups, [everything, everything], CHUNK, 6) == 6
    # Sliding chunks 0..3 evicted: they are outside the last window, still a hit of 6.
    assert longest_hit(groups, [everything, [False] * 4 + [True] * 2], CHUNK, 6) == 6
    # Sliding chunk 4 missing: boundary 6 and 5 need it; boundary 4 needs chunks 2, 3.
    assert longest_hit(groups, [everything, [True] * 4 + [False, True]], CHUNK, 6) == 4
    # A full-attention chunk missing ends the hit there, whatever the window holds.
    assert longest_hit(groups, [[True, True, False, True, True, True], everything], CHUNK, 6) == 2
    # Chunks the engine holds itself count as present.
    assert longest_hit(groups, [[False] * 2 + [True] * 4, everything], CHUNK, 6, held=2) == 6
    assert longest_hit(groups, [everything, everything], CHUNK, 3) == 3  # at most the limit


def test_a_local_attention_group_needs_only_its_attention_chunk() -> None:
    groups = [FULL, LOCAL]
    local = [False, False, False, False, True, False]
    # Boundary 6 needs no local chunk, boundary 5 chunk 4.
    assert longest_hit(groups, [[True] * 6, local], CHUNK, 6) == 6
    assert longest_hit(groups, [[True] * 5 + [False], local], CHUNK, 6) == 5


@pytest.mark.parametrize("kind", ["state", "mixed", "other"])
def test_a_kind_kvstore_does_not_store_makes_no_hit(kind: str) -> None:
    groups = [FULL, _group(1, kind)]
    assert longest_hit(groups, [[True] * 4, [True] * 4], CHUNK, 4) == 0


def test_group_keys_the_anchor_keeps_the_chunk_keys_the_others_are_their_own() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    groups = [SLIDING, FULL, _group(3, "sliding", window=40)]
    anchor = anchor_group(groups)
    assert anchor == FULL.index  # the first full-attention group
    assert group_keys(keys, FULL, anchor) == keys
    sliding = group_keys(keys, SLIDING, anchor)
    other = group_keys(keys, groups[2], anchor)
    assert len({*keys, *sliding, *other}) == 9 and all(len(k) == 16 for k in sliding)
    assert anchor_group([SLIDING]) == SLIDING.index  # all sliding: the first group
    # A group's spec is part of its fingerprint, and of the engine's layout name.
    wider = _group(1, "sliding", window=41)
    assert group_keys(keys, wider, anchor) != sliding
    assert groups_fingerprint([FULL, SLIDING]) != groups_fingerprint([FULL, wider])


def test_the_layout_plans_loads_of_only_the_window_and_never_into_null_blocks() -> None:
    layout = GroupLayout([FULL, SLIDING], CHUNK)
    assert layout.hybrid and layout.active
    keys = layout.keys([bytes([i]) * 16 for i in range(6)])
    full_ids = list(range(1, 13))
    sliding_ids = [NULL] * 9 + [30, 31, 32]  # vLLM kept tokens 144..191 of the window
    specs = layout.load_specs("r", keys, [full_ids, sliding_ids], 0, 6 * CHUNK, NULL)
    assert (
        [(s.group, s.keys, s.block_ids, s.tokens) for s in specs]
        == [
            (0, keys[0], full_ids, 6 * CHUNK),  # the anchor counts the request's tokens
            (1, keys[1][4:6], [-1, 30, 31, 32], 0),
        ]
    )
    # Tokens the engine holds (its prefix cache) are not loaded in any group.
    held = layout.load_specs("r", keys, [full_ids, sliding_ids], 5 * CHUNK, 6 * CHUNK, NULL)
    assert [(s.group, s.block_ids) for s in held] == [(0, [11, 12]), (1, [31, 32])]


def test_the_layout_saves_only_chunks_whose_blocks_the_request_still_owns() -> None:
    layout = GroupLayout([FULL, SLIDING], CHUNK)
    keys = layout.keys([bytes([i]) * 16 for i in range(3)])
    full_ids = [1, 2, 3, 4, 5, 6]
    sliding_ids = [NULL, NULL, NULL, 9, 10, 11]  # chunk 1's first block left the window
    specs = layout.save_specs("r", keys, [full_ids, sliding_ids], [1, 2], KEEP, NULL)
    assert [(s.group, s.keys, s.block_ids) for s in specs] == [
        (0, keys[0][1:3], [3, 4, 5, 6]),
        (1, keys[1][2:3], [10, 11]),
    ]


def test_the_lookup_asks_every_group_at_once_and_reads_the_hit_from_the_tiers() -> None:
    layout = GroupLayout([_group(0, "sliding", 40), _group(1, "full")], CHUNK)  # anchor: 1
    keys = layout.keys([bytes([i]) * 16 for i in range(4)])
    asked = layout.lookup_keys(keys, 4)
    assert asked == [*keys[1], *keys[0]]  # the anchor's keys first
    # Window 40 before token 128: tokens 89..127, sliding chunks 2 and 3 only.
    tiers = ["dram", "nvme", "dram", "dram", "", "", "dram", "dram"]
    hits, anchor_tiers = layout.hit(LookupResult(4, tiers), 4)
    assert (hits, anchor_tiers) == (4, ["dram", "nvme", "dram", "dram"])
    # Chunk 2 of the window gone: every shorter boundary's window reaches a chunk the store
    # lacks too (boundary 1 needs sliding chunk 0), so nothing is a hit ...
    tiers[6] = ""
    assert layout.hit(LookupResult(4, tiers), 4)[0] == 0
    # ... unless that chunk is there: boundary 1 then.
    tiers[4] = "dram"
    assert layout.hit(LookupResult(4, tiers), 4)[0] == 1


def test_one_full_group_is_the_plain_connector() -> None:
    layout = GroupLayout([FULL], CHUNK)
    assert not layout.hybrid and layout.active
    chunk_keys = [bytes([i]) * 16 for i in range(2)]
    assert layout.keys(chunk_keys) == [chunk_keys]
    assert scheme_block_size([FULL]) == BLOCK


def test_an_unsupported_group_is_said_once_and_loosens_the_block_size_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _group(1, "state", block=1056)  # a recurrent group's block size is its own
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm.hybrid"):
        layout = GroupLayout([FULL, state], CHUNK)
    assert not layout.active and layout.unsupported == ["state"]
    assert len(caplog.records) == 1 and "state" in caplog.records[0].message
    assert scheme_block_size([FULL, state]) == 1  # the engine still starts
    # Qwen3-Next-style: the recurrent page raises the attention block size to 384, which no
    # chunk size of 256 divides; nothing is stored, so nothing is refused.
    GroupLayout([_group(0, "full", block=384), _group(1, "state", block=384)], 256)
    assert scheme_block_size([FULL, _group(1, "sliding", 40, block=32)]) == 32


def _engine(device: str, layers: dict[str, tuple[int, bool]]) -> SimpleNamespace:
    """A stand-in for vLLM's config: each layer's attention impl (sliding window, sinks)."""
    context = {
        name: SimpleNamespace(
            impl=SimpleNamespace(sliding_window=window, sinks=object() if sinks else None)
        )
        for name, (window, sinks) in layers.items()
    }
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(static_forward_context=context),
    )


def test_the_cpu_sink_split_warning_names_the_cause_only_where_it_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_CPU_ATTN_SPLIT_KV", raising=False)
    gpt_oss = {"l0": (128, True), "l1": (-1, True)}  # sliding and full layers, with sinks
    names = list(gpt_oss)
    warning = sink_split_warning(_engine("cpu", gpt_oss), names)
    assert warning is not None and "VLLM_CPU_ATTN_SPLIT_KV=0" in warning
    assert sink_split_warning(_engine("cuda", gpt_oss), names) is None
    no_sinks = {"l0": (128, False), "l1": (-1, False)}  # Gemma 2 style
    assert sink_split_warning(_engine("cpu", no_sinks), names) is None
    all_sliding = {"l0": (128, True), "l1": (128, True)}  # one window: its own plan is right
    assert sink_split_warning(_engine("cpu", all_sliding), names) is None
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")
    assert sink_split_warning(_engine("cpu", gpt_oss), names) is None
