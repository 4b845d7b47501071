"""The vLLM connector's ``kv_connector_extra_config`` keys as the settings metadata describes them
(:mod:`kvstore.config.connector_keys`) are the keys the connector reads, with its defaults and
allowed values, and the generated table of docs/vllm.md lists each.

The connector's logic imports no vLLM, so this runs in the default suite."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from kvstore.config.connector_keys import LOAD_POLICIES, ConnectorKeys
from kvstore.config.meta import meta_of
from kvstore.integrations.vllm import common
from kvstore.integrations.vllm.common import ConnectorSettings
from kvstore.key_scheme import HASH_ALGORITHMS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
DESCRIBED = {spec.name: spec for spec in fields(ConnectorKeys)}
READ = {spec.name: spec for spec in fields(ConnectorSettings)}


def test_the_described_keys_are_the_keys_the_connector_reads() -> None:
    assert set(DESCRIBED) == set(common._KNOWN_KEYS)
    assert len(DESCRIBED) == 12


@pytest.mark.parametrize("key", sorted(DESCRIBED))
def test_each_key_has_the_connectors_default(key: str) -> None:
    meta = meta_of(DESCRIBED[key])
    assert meta.help
    ours, theirs = DESCRIBED[key].default, READ[key].default
    if meta.default_doc:  # from the store or the environment: documented, not a value
        return
    assert theirs is not MISSING and ours == theirs, (ours, theirs)


def test_the_choices_are_the_connectors() -> None:
    assert LOAD_POLICIES == common.LOAD_POLICIES
    assert meta_of(DESCRIBED["load_policy"]).choices == common.LOAD_POLICIES
    assert meta_of(DESCRIBED["hash_algorithm"]).choices == HASH_ALGORITHMS
    # and a value outside them is what the connector refuses
    with pytest.raises(ValueError, match="load_policy"):
        ConnectorSettings.from_extra_config({"target": "h:1", "load_policy": "sometimes"})


def test_the_vllm_page_lists_every_key() -> None:
    text = PAGE.read_text("utf-8")
    table = text.split("<!-- connector keys:", 1)[1].split("<!-- end of connector keys -->")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    assert rows == list(DESCRIBED)
