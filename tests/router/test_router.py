"""The router's pure parts: chunk keys equal the vLLM connector's, scoring, provisional entries,
settings errors. (The HTTP proxy with real processes: tests/integration/test_router_proxy.py.)"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from kvstore.cluster import Holding
from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.common import (
    ConnectorSettings,
    EngineShape,
    base_namespace,
    make_hasher,
    rank_keys,
)
from kvstore.router import Provisional, Replica, RouterKeys, Scorer, parse_namespace
from kvstore.router.body import parse_body
from kvstore.router.launch import parse_replicas
from kvstore.router.proxy import BadRequest
from kvstore.router.tokenize import prompt_tokens

SHAPE = EngineShape(
    block_size=16,
    num_layers=28,
    num_kv_heads=8,
    head_size=128,
    dtype="bfloat16",
    layout="vllm-cuda/block16/kvNHD",
    tp_size=2,
    pp_rank=0,
    pp_size=1,
)
VLLM_CONFIG = SimpleNamespace(model_config=SimpleNamespace(model="Qwen/Qwen3-8B", revision=None))


def router_namespace_json(settings: ConnectorSettings) -> str:
    """What an operator passes as ``router.namespace``: the connector's base namespace."""
    base = base_namespace(VLLM_CONFIG, SHAPE, settings, tp_rank=0)  # type: ignore[arg-type]
    fields = dataclasses.asdict(base)
    for name in ("lora_id", "cache_salt", "tp_rank"):
        del fields[name]
    return json.dumps(fields)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
@pytest.mark.parametrize(("lora", "salt"), [("", ""), ("", "salty"), ("ad@/p", "")])
def test_keys_equal_the_connectors(algorithm: str, lora: str, salt: str) -> None:
    settings = ConnectorSettings(
        target="x:1", chunk_size=64, tenant="team", secret="s3", hash_algorithm=algorithm
    )  # type: ignore[arg-type]
    base = base_namespace(VLLM_CONFIG, SHAPE, settings, tp_rank=0)  # type: ignore[arg-type]
    tokens = list(range(1000, 1000 + 64 * 5 + 17))
    expected = make_hasher(settings, base, lora, salt).keys(tokens)
    assert rank_keys(expected, base, 0, 0) == expected  # rank 0's keys are the published ones
    keys = RouterKeys(
        parse_namespace(router_namespace_json(settings)),
        64,
        "s3",
        algorithm,  # type: ignore[arg-type]
    )
    assert keys.keys(tokens, lora, salt) == expected
    assert len(expected) == 5
    # Any difference (secret, chunk size) names other chunks: misses, never wrong hits.
    other = RouterKeys(parse_namespace(router_namespace_json(settings)), 64, "", algorithm)  # type: ignore[arg-type]
    assert set(other.keys(tokens, lora, salt)).isdisjoint(expected)


def test_namespace_setting_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"router\.namespace.*not JSON"):
        parse_namespace("{model")
    with pytest.raises(ConfigError, match=r"router\.namespace: unknown fields \['modle'\]"):
        parse_namespace('{"modle": "m"}')
    with pytest.raises(ConfigError, match=r"router\.namespace"):
        parse_namespace('{"model": ""}')


def test_replica_setting_errors() -> None:
    assert parse_replicas("http://a:1=n1, http://b:2/=n2") == [
        Replica("http://a:1", "n1"),
        Replica("http://b:2", "n2"),
    ]
    for bad in ("", "http://a:1", "a:1=n", "http://a:1=n,http://a:1=m"):
        with pytest.raises(ConfigError, match=r"router\.replicas"):
            parse_replicas(bad)
    with pytest.raises(ConfigError, match=r"router\.provisional_ttl_s"):
        load_config(env={"KVSTORE_ROUTER_PROVISIONAL_TTL_S": "0"})


def test_max_body_bytes_setting() -> None:
    assert load_config(env={}).router.max_body_bytes == 16 * 1024**2
    setting = {"KVSTORE_ROUTER_MAX_BODY_BYTES": "64MiB"}
    assert load_config(env=setting).router.max_body_bytes == 64 * 1024**2
    for bad, allowed in (("2GiB", "from 1KiB"), ("100", "from 1KiB"), ("lots", "a size is")):
        with pytest.raises(ConfigError, match=rf"router\.max_body_bytes.*{allowed}"):
            load_config(env={"KVSTORE_ROUTER_MAX_BODY_BYTES": bad})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


A, B = Replica("http://a", "node-a"), Replica("http://b", "node-b")
KEYS = [bytes([i]) * 16 for i in range(8)]


def scorer(clock: Clock, request_cost: int = 64) -> Scorer:
    return Scorer([A, B], 16, 2.0, request_cost, Provisional(5.0, clock))


def test_index_holding_wins_and_faster_tier_beats_longer_slow_run() -> None:
    s = scorer(Clock())
    held = {"node-b": Holding(4, ["nvme"] * 4 + [""] * 4)}
    decision = s.choose(KEYS, 128, held)
    assert (decision.replica, decision.reason, decision.predicted_hit_tokens) == (B, "prefix", 64)
    # dram on a beats a longer nvme run on b only when it weighs more: 5 dram (64) < 8 nvme (64)?
    held = {"node-a": Holding(6, ["dram"] * 6 + [""] * 2), "node-b": Holding(8, ["nvme"] * 8)}
    assert s.choose(KEYS, 128, held).replica == A  # 6*16*0.8 = 76.8 > 8*16*0.5 = 64
    # A gap ends the run: chunks after it do not count.
    held = {"node-a": Holding(1, ["dram", "", "dram", "dram"] + [""] * 4)}
    assert s.choose(KEYS, 128, held).predicted_hit_tokens == 16
    # Engine-local chunks (the index's tier "local", from the engines' KV events) weigh most,
    # and a run may start in the engine and go on in the node's tiers.
    held = {"node-a": Holding(8, ["dram"] * 8), "node-b": Holding(8, ["local"] * 8)}
    assert s.choose(KEYS, 128, held).replica == B
    held = {"node-a": Holding(8, ["local"] * 7 + [""]), "node-b": Holding(8, ["local"] * 8)}
    assert s.choose(KEYS, 128, held).replica == B
    held = {"node-a": Holding(8, ["local"] * 4 + ["nvme"] * 4), "node-b": Holding(8, ["dram"] * 8)}
    assert s.choose(KEYS, 128, held).replica == B  # 4*16 + 4*16*0.5 = 96 < 8*16*0.8 = 102.4
    held["node-a"] = Holding(8, ["local"] * 5 + ["nvme"] * 3)  # 80 + 24 = 104 > 102.4
    assert s.choose(KEYS, 128, held).replica == A


def test_load_outweighs_a_small_hit_and_ties_rotate() -> None:
    s = scorer(Clock())
    first = s.choose([], 100, {})
    second = s.choose([], 100, {})
    assert first.reason == second.reason == "load"
    assert {first.replica, second.replica} == {A, B}  # an idle tie rotates
    s.dispatched(A, [], 1000)  # a owes 1000 prefill tokens
    held = {"node-a": Holding(3, ["dram"] * 3 + [""] * 5)}
    assert s.choose(KEYS, 128, held).replica == B
    s.prefilled(A, 1000)  # left: one request in flight (64), under the hit (2 * 3 * 16 * 0.8)
    assert s.choose(KEYS, 128, held).replica == A
    s.finished(A)
    assert s.load[A.url].in_flight == 0


def test_provisional_entries_keep_a_burst_together_then_expire() -> None:
    clock = Clock()
    s = scorer(clock, request_cost=16)  # the burst stays while its hit outweighs the load
    chosen = []
    for _ in range(4):
        decision = s.choose(KEYS, 128, {})
        prefill = 128 - decision.predicted_hit_tokens
        s.dispatched(decision.replica, KEYS, prefill)
        chosen.append(decision.replica)
    assert len(set(chosen)) == 1
    for _ in range(4):
        s.finished(chosen[0])
        s.prefilled(chosen[0], 128)
    clock.now += 5.1
    assert s.provisional.holders(KEYS) == {}
    s.provisional.record(KEYS[:1], "http://z")  # the sweep drops expired keys
    assert len(s.provisional._entries) == 1


def tokens_of(path: str, body: dict[str, object], tokenizer: object = None) -> list[int] | None:
    ids = prompt_tokens(path, parse_body(json.dumps(body).encode()), tokenizer)  # type: ignore[arg-type]
    return None if ids is None else ids.tolist()


def test_prompt_tokens_without_a_tokenizer() -> None:
    assert tokens_of("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokens_of("/v1/completions", {"prompt": [[4, 5]]}) == [4, 5]
    long = list(range(1000, 1100))  # long enough to stay bytes until asked for
    assert tokens_of("/v1/completions", {"prompt": long}) == long
    assert tokens_of("/v1/completions", {"prompt": [long]}) == long
    assert tokens_of("/v1/completions", {"prompt": [long, long]}) is None  # a batch: by load
    assert tokens_of("/v1/completions", {"prompt": "text"}) is None
    assert tokens_of("/v1/chat/completions", {"messages": []}) is None
    with pytest.raises(BadRequest, match=r"prompt\[0\]\[1\] is true"):
        tokens_of("/v1/completions", {"prompt": [[4, True]]})

    class Fake:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

        def apply_chat_template(self, conversation: object, **kwargs: object) -> list[int]:
            assert kwargs == {"tokenize": True, "add_generation_prompt": True}
            return [7, 8]

    assert tokens_of("/v1/completions", {"prompt": "ab"}, Fake()) == [97, 98]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert tokens_of("/v1/chat/completions", chat, Fake()) == [7, 8]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replica", "http://a:1=n"], "set cluster.url"),
        (
            ["--replica", "a=n", "--namespace", '{"model": "m"}'],
            "router.replicas: cannot use 'a=n'",
        ),
        (["--namespace", '{"model": "m"}'], "router.replicas is empty"),
        (
            ["--replica", "http://a:1=n", "--namespace", '{"model": "m"}', "--listen", "x"],
            "router.listen",
        ),
    ],
)
def test_router_command_errors_are_one_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstore.cli import main

    for name in ("KVSTORE_CONFIG", "KVSTORE_CLUSTER_URL", "KVSTORE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    assert main(["router", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_baseline_policies_ignore_the_cache() -> None:
    held = {"node-b": Holding(8, ["dram"] * 8)}
    s = Scorer([A, B], 16, 2.0, 64, Provisional(5.0, Clock()), policy="round_robin")
    s.dispatched(A, KEYS, 1000)  # round robin ignores load too: a is next in turn all the same
    picks = [s.choose(KEYS, 128, held) for _ in range(4)]
    assert [d.replica for d in picks] == [A, B, A, B]
    assert {d.reason for d in picks} == {"round_robin"}
    assert {d.predicted_hit_tokens for d in picks} == {0}

    s = Scorer([A, B], 16, 2.0, 64, Provisional(5.0, Clock()), policy="least_loaded")
    s.dispatched(B, KEYS, 10)  # b holds every chunk (index and provisional) but owes 10 tokens
    for _ in range(3):
        decision = s.choose(KEYS, 128, {"node-b": Holding(8, ["local"] * 8)})
        assert (decision.replica, decision.reason) == (A, "load")
    s.dispatched(A, [], 500)
    assert s.choose(KEYS, 128, held).replica == B


def test_policy_setting_names_the_allowed_values() -> None:
    assert load_config(env={}).router.policy == "kv"
    assert (
        load_config(env={"KVSTORE_ROUTER_POLICY": "least_loaded"}).router.policy == "least_loaded"
    )
    with pytest.raises(
        ConfigError,
        match=r"router\.policy must be one of kv, round_robin, least_loaded, got 'random'",
    ):
        load_config(env={"KVSTORE_ROUTER_POLICY": "random"})
