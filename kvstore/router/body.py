"""A request's JSON body as the router reads it: parsed at a bounded cost in memory and time.

A prompt given as token ids is a JSON array of numbers, up to millions of them. ``json.loads``
makes a list of Python ints of it, ~36 bytes a token where the JSON took 6 (a body just under
64 MiB took the router from 61 MiB to 1 GiB), in one call that holds the interpreter for
seconds. So :func:`parse_body`:

1. finds every string and every array of nothing but numbers (64 bytes or more of them) with
   regular expressions that scan at most 1 MiB a call, and counts the JSON values outside
   those arrays (:data:`MAX_VALUES` at most, before anything is built);
2. parses the rest with ``json``, each such array replaced by a placeholder string, and checks
   its nesting (:data:`MAX_DEPTH` levels at most);
3. leaves the arrays as bytes of the body. :meth:`ParsedBody.token_ids` turns the one the router
   needs, the prompt, into a ``uint32`` array a 256 KiB segment at a time (4 bytes a token), and
   :meth:`ParsedBody.encode` writes a changed body (P/D mode) with them copied back verbatim.

Every step's cost is bounded by the body's size, and a thread running it lets the event loop
answer others between calls: only the decoding and ``json`` parse of what is left (text, once
the arrays of numbers are out) are one call each, ~5 ms a MiB. A malformed body raises
:class:`~kvstore.router.proxy.BadRequest` (400) saying what is wrong and where.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.router.proxy import BadRequest

__all__ = [
    "MAX_DEPTH",
    "MAX_TOKEN_ID",
    "MAX_VALUES",
    "ParsedBody",
    "TokenIds",
    "as_token_ids",
    "parse_body",
]

#: A prompt's token ids (chunk keys hash them as little-endian uint32, as the connector does).
TokenIds = npt.NDArray[np.uint32]

#: JSON values a body may have outside its arrays of numbers: each becomes a Python object of
#: 50-250 bytes, so this bounds the parse to a few tens of MiB whatever the body. Far above what
#: a request carries (a chat of 10,000 messages is ~60,000).
MAX_VALUES = 200_000
#: How deeply a body's JSON may nest (OpenAI requests nest a few levels; JSON schemas a few more).
MAX_DEPTH = 128
#: The largest token id (ids are uint32 in chunk keys; engines refuse ids past their vocabulary).
MAX_TOKEN_ID = 2**32 - 1

_NUMBER_CHARS = rb"[0-9 \t\n\r,.eE+\-]"
#: An array of numbers at least this long (bytes) is kept as bytes, not parsed with the rest.
_SPAN_MIN = 64
#: The most one regular-expression call scans (~1-7 ms): the parsing thread lets go of the
#: interpreter between calls.
_WINDOW = 1 << 20
#: The most one ``json.loads`` of token ids parses (~3 ms, a few MiB of Python ints at most).
_SEGMENT = 1 << 18
# Where a string starts, or "[" followed by at least _SPAN_MIN characters numbers are made of.
_SCAN = re.compile(rb'"|\[(?=' + _NUMBER_CHARS + rb"{%d})" % _SPAN_MIN)
# A string's characters up to its closing quote. Possessive: the regular expression engine keeps
# no backtracking state per escape (the usual unrolled pattern took 146 MiB for a 16 MiB string
# of escapes).
_STRING = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
_RUN = re.compile(_NUMBER_CHARS + rb"*")
_BLANK = re.compile(rb"[ \t\n\r]*")
_RANGE = f"token ids are integers in [0, {MAX_TOKEN_ID}]"


class _NotInteger(Exception):
    """A token id written with a fraction or an exponent."""


def _reject_float(text: str) -> float:
    raise _NotInteger(text)


def _show(value: Any) -> str:
    """``value`` as JSON, cut short: messages quote what they refuse without echoing a body."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_token_ids(value: list[Any], where: str) -> TokenIds:
    """``value`` (a JSON array, parsed) as token ids; :class:`BadRequest` naming the first
    element that is not an integer in [0, :data:`MAX_TOKEN_ID`]."""
    for index, item in enumerate(value):
        if type(item) is not int or not 0 <= item <= MAX_TOKEN_ID:  # bool is an int subclass
            raise BadRequest(400, f"{where}[{index}] is {_show(item)}: {_RANGE}")
    return np.array(value, dtype=np.uint32)


@dataclass(frozen=True)
class ParsedBody:
    """A JSON object body: ``value`` with each long array of numbers a placeholder string."""

    #: The body, parsed; placeholders stand for the arrays of :attr:`spans`.
    value: dict[str, Any]
    data: bytes | bytearray
    #: ``(start, end)`` in :attr:`data` of each array kept as bytes, brackets included.
    spans: tuple[tuple[int, int], ...]
    #: What every placeholder starts with (random per body: a client cannot forge one).
    tag: str

    def span(self, item: Any) -> tuple[int, int] | None:
        """Where in the body the array ``item`` stands for is (``None``: not a placeholder)."""
        if isinstance(item, str) and item.startswith(self.tag):
            number = item[len(self.tag) :]
            if number.isdigit() and int(number) < len(self.spans):
                return self.spans[int(number)]
        return None

    def is_array(self, item: Any) -> bool:
        """Whether ``item`` (a value of :attr:`value`) is a JSON array in the body."""
        return isinstance(item, list) or self.span(item) is not None

    def token_ids(self, item: Any, where: str) -> TokenIds | None:
        """``item`` as token ids if it is an array of them (``None`` if it is no array);
        :class:`BadRequest` if an element is not an integer in [0, :data:`MAX_TOKEN_ID`]."""
        if isinstance(item, list):
            return as_token_ids(item, where)
        span = self.span(item)
        return None if span is None else _parse_ids(self.data, *span, where)

    def encode(self, value: Any) -> bytes:
        """``value`` (built from :attr:`value`) as JSON, each placeholder the array it stands
        for, byte for byte."""
        text = json.dumps(value).encode()
        if not self.spans:
            return text
        placeholder = re.compile(b'"' + re.escape(self.tag.encode()) + rb'(\d+)"')
        return placeholder.sub(lambda m: bytes(self.data[slice(*self.spans[int(m[1])])]), text)


def parse_body(data: bytes | bytearray) -> ParsedBody:
    """``data``, a JSON object, parsed as the module says; :class:`BadRequest` (400) if it is
    not valid UTF-8 JSON, not an object, has more than :data:`MAX_VALUES` values outside arrays
    of numbers or nests deeper than :data:`MAX_DEPTH` levels."""
    tag = f"kvstore-array:{secrets.token_hex(8)}:"
    view = memoryview(data)
    pieces: list[bytes | memoryview] = []
    spans: list[tuple[int, int]] = []
    values, position, copied, size = 0, 0, 0, len(data)
    while (match := _SCAN.search(data, position)) is not None:
        start = match.start()
        # Commas and openings between strings and arrays of numbers: one value each, at most.
        values += 1 + _structure(data, position, start)
        if values > MAX_VALUES:
            raise _too_many()
        if data[start] == ord('"'):
            end = _scan(_STRING, data, start + 1)
            position = end + 1 if end < size else size  # past the closing quote, if any
            continue
        end = _scan(_RUN, data, start + 1)
        if end < size and data[end] == ord("]"):  # an array of nothing but numbers
            pieces += [view[copied:start], f'"{tag}{len(spans)}"'.encode()]
            spans.append((start, end + 1))
            position = copied = end + 1
        else:  # numbers, then something else: an ordinary array
            values += _structure(data, start, end)
            position = end
    values += _structure(data, position, size)
    if values > MAX_VALUES:
        raise _too_many()
    pieces.append(view[copied:])
    try:  # without arrays kept as bytes, decoded from the body itself: no copy of it first
        text = str(b"".join(pieces) if spans else data, "utf-8")
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        raise BadRequest(400, f"the body is not UTF-8 (byte 0x{byte}: {exc.reason})") from None
    del pieces
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise BadRequest(400, f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(400, "the body is not a JSON object")
    _check_depth(value)
    return ParsedBody(value, data, tuple(spans), tag)


def _scan(pattern: re.Pattern[bytes], data: bytes | bytearray, start: int) -> int:
    """Where ``pattern`` (which matches the empty string) stops matching from ``start``, a
    window at a time (a window may end inside a two-byte escape: the next one starts there)."""
    end, size = start, len(data)
    while True:
        stop = min(end + _WINDOW, size)
        end = pattern.match(data, end, stop).end()  # type: ignore[union-attr]  # matches ""
        if end < stop - 1 or stop == size:
            return end


def _structure(data: bytes | bytearray, start: int, end: int) -> int:
    """How many values ``data[start:end]`` (outside strings) can start, at most."""
    return (
        data.count(b",", start, end) + data.count(b"[", start, end) + data.count(b"{", start, end)
    )


def _too_many() -> BadRequest:
    return BadRequest(
        400,
        f"the body has more than {MAX_VALUES} JSON values outside arrays of numbers "
        "(a limit of its own: router.max_body_bytes does not change it)",
    )


def _too_deep() -> BadRequest:
    return BadRequest(400, f"the body nests JSON deeper than {MAX_DEPTH} levels")


def _check_depth(value: Any) -> None:
    """:class:`BadRequest` if ``value`` nests deeper than :data:`MAX_DEPTH` levels."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth > MAX_DEPTH:
                raise _too_deep()
            stack.extend((child, depth + 1) for child in item)


def _parse_ids(data: bytes | bytearray, start: int, end: int, where: str) -> TokenIds:
    """The array of numbers ``data[start:end]`` as token ids, a segment at a time."""
    first, last = start + 1, end - 1  # inside the brackets
    if _BLANK.match(data, first, last).end() == last:  # type: ignore[union-attr]  # matches ""
        return np.empty(0, dtype=np.uint32)
    count = data.count(b",", first, last) + 1
    out = np.empty(count, dtype=np.uint32)
    filled, position = 0, first
    while position < last:
        stop = last
        if stop - position > _SEGMENT:  # cut after a whole number
            stop = data.rfind(b",", position, position + _SEGMENT)
            if stop < 0:
                raise BadRequest(400, f"{where} has an element over {_SEGMENT} bytes long")
        try:
            numbers = json.loads(b"[" + data[position:stop] + b"]", parse_float=_reject_float)
        except _NotInteger as exc:
            raise BadRequest(400, f"{where}: {exc} is not an integer ({_RANGE})") from None
        except ValueError as exc:
            raise BadRequest(400, f"{where} is not a JSON array of numbers: {exc}") from None
        if numbers and not 0 <= min(numbers) <= max(numbers) <= MAX_TOKEN_ID:
            index, bad = next((i, n) for i, n in enumerate(numbers) if not 0 <= n <= MAX_TOKEN_ID)
            raise BadRequest(400, f"{where}[{filled + index}] is {_show(bad)}: {_RANGE}")
        if filled + len(numbers) > count:
            break
        out[filled : filled + len(numbers)] = numbers
        filled += len(numbers)
        position = stop + 1
    if filled != count:  # an empty element: "[1,,2]" or "[1,2,]"
        raise BadRequest(400, f"{where} is not a JSON array of numbers")
    return out
