"""A request's prompt as token ids, with the model's own tokenizer files.

``/v1/completions`` with ``prompt`` given as token ids (a list of ints) needs no tokenizer. Text
prompts and ``/v1/chat/completions`` need ``router.tokenizer`` (a local directory or model id of
Hugging Face tokenizer files, loaded with ``transformers``' ``AutoTokenizer``); chat messages go
through the tokenizer's chat template with the generation prompt added, as vLLM's OpenAI server
does. Without a tokenizer, or when tokenizing fails, the prompt has no token ids and the request
is routed by load alone (``no_tokens``). Ids the request gives are checked (an id that is not an
integer in [0, 2**32) is a 400); a batch of several prompts is routed by load.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvstore.errors import ConfigError
from kvstore.router.body import ParsedBody, TokenIds, as_token_ids

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


def prompt_tokens(path: str, body: ParsedBody, tokenizer: Tokenizer | None) -> TokenIds | None:
    """The prompt's token ids as the engine will see them, or ``None`` when not known.

    Raises :class:`~kvstore.router.proxy.BadRequest` if the request gives token ids and one is
    not an integer in [0, 2**32).
    """
    value = body.value
    if path.endswith("/chat/completions"):
        messages = value.get("messages")
        if tokenizer is None or not isinstance(messages, list):
            return None
        return _tokenized(
            path,
            lambda: tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True
            ),
        )
    prompt: Any = value.get("prompt")
    where = "prompt"
    # A list of prompts (texts or arrays of ids) rather than one array of ids?
    batch = isinstance(prompt, list) and bool(prompt)
    batch = batch and (isinstance(prompt[0], str) or body.is_array(prompt[0]))
    if batch and len(prompt) == 1:
        prompt, where, batch = prompt[0], "prompt[0]", False
    if isinstance(prompt, str) and body.span(prompt) is None:
        if tokenizer is None:
            return None
        return _tokenized(path, lambda: tokenizer.encode(prompt, add_special_tokens=True))
    if batch:  # of several prompts: routed by load
        return None
    return body.token_ids(prompt, where)


def _tokenized(path: str, encode: Callable[[], Any]) -> TokenIds | None:
    """What the tokenizer makes of a prompt; ``None`` if it fails."""
    try:
        ids = encode()
        if isinstance(ids, Mapping):  # some tokenizers answer a BatchEncoding
            ids = ids["input_ids"]
        return as_token_ids(list(ids), "the tokenized prompt")
    except Exception as exc:  # a prompt the tokenizer rejects is routed by load, never failed
        logger.debug("cannot tokenize a %s prompt: %s", path, exc)
    return None
