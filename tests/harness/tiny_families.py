"""Tiny random-weight models of the families vLLM groups into several KV cache groups.

Each family is a ``transformers`` config small enough that vLLM's CPU build starts it in about
twenty seconds, with random weights saved by ``save_pretrained`` and the word-level tokenizer of
:mod:`.tiny_model`. The shapes keep what makes the family hybrid under vLLM (which layers slide,
their window, sinks, chunked local attention, MLA, recurrent layers); everything else is as
small as the kernels allow (the CPU attention kernels want head sizes that are a multiple of 32;
the GDN kernels want 128). Windows are 128 tokens, smaller than the suite's prompts, so a wrong
window would show in the outputs.

Usage::

    python tests/vllm_engine/tiny_families.py gpt_oss /tmp/tiny-gpt-oss
    python tests/vllm_engine/tiny_families.py --list
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.tiny_model import save_tokenizer

__all__ = ["FAMILIES", "Family", "build_family"]

WINDOW = 128
_VOCAB = 1024
_COMMON: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
_MARKER = "kvstore-tiny-family.json"
_RECIPE = 1


@dataclass(frozen=True)
class Family:
    """One model family: its ``transformers`` config and how vLLM runs it here."""

    name: str
    model_type: str
    config: dict[str, Any]
    #: The checkpoint's dtype. vLLM's CPU build runs a float32 checkpoint in bf16 (it downcasts),
    #: so every family here runs in bf16; float32 weights only keep the random init exact.
    dtype: str = "float32"
    #: vLLM engine arguments the family needs on this CPU build (say why where one is set).
    engine: dict[str, Any] = field(default_factory=dict)
    #: Environment the engine needs.
    env: dict[str, str] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # Three sliding-window layers and one global one: vLLM makes one group per layer.
        Family(
            "gemma3",
            "gemma3_text",
            {
                "head_dim": 64,
                "query_pre_attn_scalar": 64,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
                "tie_word_embeddings": True,
            },
        ),
        # Alternating sliding and global layers, with logit soft-capping.
        Family(
            "gemma2",
            "gemma2",
            {
                "head_dim": 64,
                "query_pre_attn_scalar": 64,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "tie_word_embeddings": True,
            },
        ),
        # Alternating sliding and global layers with attention sinks, and a small MoE.
        Family(
            "gpt_oss",
            "gpt_oss",
            {
                "head_dim": 64,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "intermediate_size": 256,
            },
            dtype="bfloat16",
        ),
        # Every layer slides: one sliding-window group.
        Family("mistral", "mistral", {"head_dim": 64, "sliding_window": WINDOW}),
        # Chunked local attention on three layers of four (vLLM turns the hybrid manager off for
        # it unless told otherwise: the variable below says otherwise).
        Family(
            "llama4",
            "llama4_text",
            {
                "head_dim": 64,
                "intermediate_size_mlp": 512,
                "attention_chunk_size": WINDOW,
                "no_rope_layers": [1, 1, 1, 0],
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
            },
            env={"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"},
        ),
        # Multi-head latent attention (one compressed row per token), dense MLPs. vLLM's MLA
        # backends take a row of 320, 512 or 576 (kv_lora_rank + qk_rope_head_dim) only.
        Family(
            "deepseek_v2",
            "deepseek_v2",
            {
                "kv_lora_rank": 256,
                "q_lora_rank": None,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 64,
                "v_head_dim": 64,
                "first_k_dense_replace": 4,
                "n_routed_experts": 2,
                "n_shared_experts": 1,
                "num_experts_per_tok": 1,
                "moe_intermediate_size": 128,
                "num_key_value_heads": 4,
            },
        ),
        # Gated DeltaNet layers beside full attention; the GDN kernels want bf16 and 128-wide heads.
        Family(
            "qwen3_next",
            "qwen3_next",
            {
                "head_dim": 64,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
                "shared_expert_intermediate_size": 128,
            },
            dtype="bfloat16",
        ),
        # Mamba2 layers beside attention.
        Family(
            "granite_hybrid",
            "granitemoehybrid",
            {
                "layer_types": ["mamba", "mamba", "mamba", "attention"],
                "mamba_n_heads": 8,
                "mamba_d_head": 64,
                "mamba_d_state": 64,
                "mamba_n_groups": 1,
                "mamba_chunk_size": 128,
                "num_local_experts": 0,
                "shared_intermediate_size": 512,
                "position_embedding_type": "rope",
            },
            # vLLM's Mamba2 path fails its first prefill here with prefix caching on (an
            # IndexError inside vLLM), so this family runs with it off.
            engine={"no_prefix_caching": True},
        ),
    )
}


def build_family(name: str, path: str | Path, *, seed: int = 0) -> Path:
    """Write family ``name``'s tiny random model and tokenizer to ``path``; return the path.

    A directory already built from the same recipe is reused.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    family = FAMILIES[name]
    out = Path(path)
    spec = {
        "family": name,
        "seed": seed,
        "recipe": _RECIPE,
        "config": family.config,
        "dtype": family.dtype,
    }
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(family.model_type, **{**_COMMON, **family.config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # As in tiny_model: strong attention outputs make every token depend on the whole context
    # (wrong KV shows) and widen the gap between the top two logits (greedy outputs stay equal
    # across engines that add in different orders).
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name.rsplit(".", 1)[-1] in ("v_proj", "o_proj"):
                module.weight.mul_(20.0)
    model = model.to(getattr(torch, family.dtype))
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out, _VOCAB)
    marker.write_text(json.dumps(spec, sort_keys=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", nargs="?", choices=sorted(FAMILIES))
    parser.add_argument("path", nargs="?")
    parser.add_argument("--list", action="store_true", help="print the family names")
    args = parser.parse_args()
    if args.list or not args.family or not args.path:
        print("\n".join(sorted(FAMILIES)))
        return
    print(build_family(args.family, args.path))


if __name__ == "__main__":
    main()
