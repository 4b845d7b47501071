"""The router's body parser (:mod:`kvstore.router.body`): the same answer as ``json.loads``
for every body it accepts, token ids a segment at a time, and a 400 naming what is wrong for
every body it refuses. (The router process under bad input: test_router_bad_input.py.)"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from kvstore.router.body import MAX_DEPTH, MAX_VALUES, ParsedBody, parse_body
from kvstore.router.proxy import BadRequest

IDS = list(range(100_000, 100_000 + 70_000))  # 560 KB as JSON: three 256 KiB segments


def restored(body: ParsedBody) -> Any:
    """The body's value with every placeholder the array it stands for (as json.loads sees it)."""

    def walk(item: Any) -> Any:
        span = body.span(item)
        if span is not None:
            return json.loads(bytes(body.data[span[0] : span[1]]))
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, list):
            return [walk(v) for v in item]
        return item

    return walk(body.value)


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": IDS, "model": "m", "max_tokens": 3},
        {"prompt": [IDS[:100], IDS[:5]], "stream": True},
        {"messages": [{"role": "user", "content": 'say "[1, 2, 3]" ' + "1, " * 200}]},
        {"prompt": "x", "logit_bias": {"5": -100}, "stop_token_ids": list(range(50))},
        {"prompt": [1.5] * 30 + [1e300], "nested": {"a": [[1, 2], [3.0, -4e-2]] * 20}},
        {
            "prompt": [],
            "empty": "",
            "unicode": "caf\u00e9 \u2603 \U0001f600",
            "esc": 'a\\"b\\u0041',
        },
        # Quotes and backslashes in strings: numbers inside a string stay in it.
        {"text": 'a \\" [' + "1, " * 40 + "2] \\", "after": [5] * 40, "end": "\\"},
    ],
)
def test_the_same_value_as_json_loads(value: dict[str, Any]) -> None:
    data = json.dumps(value).encode()
    body = parse_body(data)
    assert restored(body) == json.loads(data)
    # Written back (P/D mode), the kept arrays are the body's own bytes.
    assert body.encode(body.value) == data
    spaced = json.dumps(value, indent=2).encode()
    assert restored(parse_body(spaced)) == value


def test_token_ids_come_back_as_uint32_without_a_list_of_ints() -> None:
    data = json.dumps({"prompt": IDS}).encode()
    body = parse_body(data)
    assert body.spans and body.span(body.value["prompt"]) == body.spans[0]
    ids = body.token_ids(body.value["prompt"], "prompt")
    assert ids is not None and ids.dtype == np.uint32 and ids.tolist() == IDS
    # Whitespace, the extremes, an empty array.
    text = b'{"prompt": [ 0 ,\n4294967295\t, ' + b"7, " * 40 + b"7 ]}"
    spaced = parse_body(text)
    got = spaced.token_ids(spaced.value["prompt"], "prompt")
    assert got is not None and got.tolist() == [0, 4294967295] + [7] * 41
    blank = parse_body(b'{"prompt": [' + b" " * 100 + b"]}")
    assert blank.token_ids(blank.value["prompt"], "prompt").tolist() == []  # type: ignore[union-attr]
    assert body.token_ids("not a placeholder", "prompt") is None


def test_a_placeholder_cannot_be_forged() -> None:
    first = parse_body(json.dumps({"prompt": IDS}).encode())
    forged = json.dumps({"prompt": first.value["prompt"], "x": IDS}).encode()
    second = parse_body(forged)
    assert second.span(second.value["prompt"]) is None  # another body's tag means nothing here
    assert second.token_ids(second.value["prompt"], "prompt") is None


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([*IDS[:50_000], "-3", *IDS[:10]], "prompt[50000] is -3"),  # in the second segment
        ([*IDS, "4294967296"], "prompt[70000] is 4294967296"),  # the last element
        ([*IDS[:40_000], "2.0", *IDS[:10]], "2.0 is not an integer"),
        ([*IDS[:40_000], "1E5"], "1E5 is not an integer"),
        ([*IDS[:40_000], "", *IDS[:10]], "not a JSON array of numbers"),  # "1,,2"
        ([*IDS, ""], "not a JSON array of numbers"),  # a trailing comma
        ([*IDS[:10], "01"], "not a JSON array of numbers"),
        ([*IDS[:10], "1 2"], "not a JSON array of numbers"),
        ([*IDS[:10], "1" + " " * 300_000], "an element over 262144 bytes"),
    ],
)
def test_bad_token_ids_name_the_element(ids: list[Any], message: str) -> None:
    data = b'{"prompt": [' + ",".join(map(str, ids)).encode() + b"]}"
    body = parse_body(data)  # the rest of the body is fine: only the ids are wrong
    with pytest.raises(BadRequest, match=re.escape(message)) as info:
        body.token_ids(body.value["prompt"], "prompt")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": ' + b"[" * (MAX_DEPTH) + b"]" * (MAX_DEPTH) + b"}", "deeper than 128"),
        (b"[" * (MAX_VALUES + 1) + b"]" * (MAX_VALUES + 1), "more than 200000 JSON values"),
        (b'{"a": [' + b'"x",' * MAX_VALUES + b'"x"]}', "more than 200000 JSON values"),
        (b'{"a": [' + b"{}," * MAX_VALUES + b"{}]}", "more than 200000 JSON values"),
        (b'{"a": "\xff"}', "not UTF-8 .byte 0xff"),
        (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate
        (b'{"a": 1', "not JSON"),
        (b'{"a": 1}{}', "not JSON"),
        (b"", "not JSON"),
        (b'{"a": 1' + b"0" * 5000 + b"}", "not JSON"),  # past Python's digits limit
        (b'"text"', "not a JSON object"),
        (json.dumps({"prompt": IDS})[:-1].encode(), "not JSON"),
    ],
)
def test_malformed_bodies_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        parse_body(data)
    assert info.value.status == 400


def test_the_limits_leave_room_for_real_requests() -> None:
    just_deep = b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert parse_body(just_deep).value
    chat = {"messages": [{"role": "user", "content": f"message {i}"} for i in range(10_000)]}
    assert parse_body(json.dumps(chat).encode()).value == chat
    text = {"prompt": "a, [b], {c}, " * 1_000_000}  # 13 MB of text with brackets and commas
    assert parse_body(json.dumps(text).encode()).value == text
