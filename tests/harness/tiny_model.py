"""Build a tiny random-weight Llama on local disk: vLLM tests and benchmarks need no download.

The model is a ``transformers`` :class:`~transformers.LlamaConfig` with random weights saved with
``save_pretrained``, plus a ``tokenizers`` WordLevel tokenizer (tokens ``t0`` ... ``t{vocab-1}``)
saved as a Hugging Face fast tokenizer. Tests feed token ids directly (``TokensPrompt``), so the
tokenizer only has to exist and load; the weights only have to be deterministic, which a fixed
seed gives.

Usage::

    python tests/vllm_engine/tiny_model.py /tmp/tiny-llama            # defaults below
    python tests/vllm_engine/tiny_model.py /tmp/big --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_SIZES", "build_tiny_llama", "save_tokenizer"]

DEFAULT_SIZES: dict[str, int] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
}

_MARKER = "kvstore-tiny-llama.json"


def build_tiny_llama(path: str | Path, *, seed: int = 0, **sizes: int) -> Path:
    """Write a random Llama and its tokenizer to ``path`` and return the path.

    ``sizes`` override :data:`DEFAULT_SIZES` (any ``LlamaConfig`` integer field). A directory
    already built with the same sizes and seed is reused, so callers may call this freely.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    spec: dict[str, Any] = {**DEFAULT_SIZES, **sizes, "seed": seed, "recipe": 2}
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)

    config_args = {k: v for k, v in spec.items() if k not in ("seed", "recipe")}
    config = LlamaConfig(
        **config_args,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Plain random init leaves the attention path weak next to the residual stream. Scaling the
    # value and output projections up makes every output token depend strongly on the whole
    # context (a test that compares outputs then notices wrong KV) and widens the gap between
    # the top two logits (greedy outputs stay exactly equal across engines that add
    # floating-point numbers in different orders).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(20.0)
            layer.self_attn.o_proj.weight.mul_(20.0)
    model.save_pretrained(out, safe_serialization=True)

    save_tokenizer(out, spec["vocab_size"])
    marker.write_text(json.dumps(spec, sort_keys=True))
    return out


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """Save the word-level tokenizer of ``vocab_size`` tokens ``t0`` ... as a fast tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--vocab", type=int, default=DEFAULT_SIZES["vocab_size"])
    parser.add_argument("--hidden", type=int, default=DEFAULT_SIZES["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=DEFAULT_SIZES["intermediate_size"])
    parser.add_argument("--layers", type=int, default=DEFAULT_SIZES["num_hidden_layers"])
    parser.add_argument("--heads", type=int, default=DEFAULT_SIZES["num_attention_heads"])
    parser.add_argument("--kv-heads", type=int, default=DEFAULT_SIZES["num_key_value_heads"])
    args = parser.parse_args()
    path = build_tiny_llama(
        args.path,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    print(path)


if __name__ == "__main__":
    main()
