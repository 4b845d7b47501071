"""A request's prompt as token ids, with the model's own tokenizer files.

``/v1/completions`` with ``prompt`` given as token ids (a list of ints) needs no tokenizer. Text
prompts and ``/v1/chat/completions`` need ``router.tokenizer`` (a local directory or model id of
Hugging Face tokenizer files, loaded with ``transformers``' ``AutoTokenizer``); chat messages go
through the tokenizer's chat template with the generation prompt added, as vLLM's OpenAI server
does. Without a tokenizer, or when tokenizing fails, the prompt has no token ids and the request
is routed by load alone (``no_tokens``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from kvstore.errors import ConfigError

__all__ = ["Tokenizer", "load_tokenizer", "prompt_tokens"]

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the router needs of a tokenizer (``transformers``' tokenizers have it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """Token ids of a conversation with its template applied."""
        ...


def load_tokenizer(name: str) -> Tokenizer | None:
    """The tokenizer of ``router.tokenizer`` (``None`` when the setting is empty)."""
    if not name:
        return None
    try:
        # Only a router with a tokenizer needs transformers (the default install lacks it).
        auto = importlib.import_module("transformers").AutoTokenizer
    except ImportError as exc:
        raise ConfigError(
            f"router.tokenizer {name!r} needs the transformers package, which is not installed"
        ) from exc
    try:
        tokenizer: Tokenizer = auto.from_pretrained(name)
    except Exception as exc:  # any failure to load is a configuration error, named as such
        raise ConfigError(f"router.tokenizer: cannot load {name!r}: {exc}") from exc
    return tokenizer


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return value
    return None


def prompt_tokens(
    path: str, body: Mapping[str, Any], tokenizer: Tokenizer | None
) -> list[int] | None:
    """The prompt's token ids as the engine will see them, or ``None`` when not known."""
    try:
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if tokenizer is None or not isinstance(messages, list):
                return None
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, Mapping):  # some tokenizers answer a BatchEncoding
                ids = ids["input_ids"]
            return _ids(list(ids))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        direct = _ids(prompt)
        if direct is not None:
            return direct
        if isinstance(prompt, str) and tokenizer is not None:
            return _ids(tokenizer.encode(prompt, add_special_tokens=True))
    except Exception as exc:  # a prompt the tokenizer rejects is routed by load, never failed
        logger.debug("cannot tokenize a %s prompt: %s", path, exc)
    return None
