"""Golden vectors of key scheme v1: any change to how keys are computed fails here.

The vectors in ``golden/keys_v1.json`` were written once by ``golden/make_keys_v1.py``. A failure
means stored blocks would no longer be found (or, worse, be confused): fix the code, do not
regenerate the file. A deliberate scheme change gets a new version and a new vectors file.

This test rebuilds namespaces, secrets and token sequences from the JSON file and its own code,
never from the generator script, so editing the script cannot move the goalposts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.keys import ChunkHasher, Namespace

GOLDEN = json.loads((Path(__file__).parent / "golden" / "keys_v1.json").read_text("utf-8"))


def lcg(count: int, seed: int = 12345) -> list[int]:
    out, x = [], seed
    for _ in range(count):
        x = (1664525 * x + 1013904223) % 2**32
        out.append(x)
    return out


SEQUENCES = {"range1000": list(range(1000)), "lcg1030": lcg(1030)}


def _case_id(case: dict[str, Any]) -> str:
    return "-".join(
        str(case[k]) for k in ("namespace", "secret", "algorithm", "chunk_size", "tokens")
    )


def test_golden_file_is_v1_and_complete() -> None:
    assert GOLDEN["scheme"] == "kvstore-chain-v1"
    assert set(GOLDEN["namespaces"]) == {"model-only", "full"}
    combos = {
        (c["namespace"], c["secret"], c["algorithm"], c["chunk_size"], c["tokens"])
        for c in GOLDEN["cases"]
    }
    expected = set(
        itertools.product(
            ["model-only", "full"],
            ["none", "secret"],
            ["xxh3_128", "sha256"],
            [4, 256],
            ["range1000", "lcg1030"],
        )
    )
    assert combos == expected
    assert len(GOLDEN["cases"]) == len(expected)


def test_sequences_match_their_description() -> None:
    # Guards the test's own token generator: the LCG is full-range 32-bit.
    assert SEQUENCES["lcg1030"][:3] == [87628868, 71072467, 2332836374]
    assert max(SEQUENCES["lcg1030"]) > 2**31


@pytest.mark.parametrize("name", sorted(GOLDEN["namespaces"]))
def test_namespace_fingerprints(name: str) -> None:
    entry = GOLDEN["namespaces"][name]
    assert Namespace(**entry["fields"]).fingerprint().hex() == entry["fingerprint"]


def test_model_only_namespace_is_the_default_namespace() -> None:
    fields = GOLDEN["namespaces"]["model-only"]["fields"]
    assert Namespace(model=fields["model"]) == Namespace(**fields)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_golden_keys(case: dict[str, Any]) -> None:
    namespace = Namespace(**GOLDEN["namespaces"][case["namespace"]]["fields"])
    secret = bytes.fromhex(GOLDEN["secrets_hex"][case["secret"]])
    hasher = ChunkHasher(case["chunk_size"], namespace, secret=secret, algorithm=case["algorithm"])
    keys = hasher.keys(SEQUENCES[case["tokens"]])

    assert hasher.root.hex() == case["root"]
    assert len(keys) == case["num_keys"]
    assert [k.hex() for k in keys[: len(case["keys_head"])]] == case["keys_head"]
    assert keys[-1].hex() == case["last_key"]
    assert hashlib.sha256(b"".join(keys)).hexdigest() == case["all_keys_sha256"]
