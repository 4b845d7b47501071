"""``docs/sglang.md``'s commands, as written: the store's, run; the SGLang server's extra config,
made into the backend by SGLang's storage factory, with the page size the command gives.

The commands are read from the fenced blocks after ``<!-- tested: sglang-store -->`` and
``<!-- tested: sglang-server -->``, so the page and the tests cannot drift apart (the engine tier
runs the server command itself, on a CPU). Only the store's address is replaced.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from harness.serve import ServerProcess
from harness.sglang_contract import hashes, host_pool, open_backend, page_indices, storage_config

DOC = Path(__file__).parents[2] / "docs" / "sglang.md"


def documented(marker: str) -> str:
    """The command in the fenced block after ``<!-- tested: MARKER -->`` in docs/sglang.md."""
    tag = f"<!-- tested: {marker} -->"
    match = re.search(re.escape(tag) + r"\s*```(?:bash|sh)?\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert match, f"docs/sglang.md has no fenced block after {tag}"
    return match.group(1).strip()


def flag(words: list[str], name: str) -> str:
    assert name in words, f"the documented command has no {name}"
    return words[words.index(name) + 1]


def test_the_documented_commands_start_a_store_and_the_backend(tmp_path: Path) -> None:
    store_words = shlex.split(documented("sglang-store"))
    env = dict(word.split("=", 1) for word in store_words if "=" in word and word[0].isupper())
    assert [w for w in store_words if w not in {f"{k}={v}" for k, v in env.items()}] == [
        "kvstore",
        "serve",
    ]
    server_words = shlex.split(documented("sglang-server"))
    assert server_words[:3] == ["python", "-m", "sglang.launch_server"]
    for needed in ("--enable-hierarchical-cache", "--hicache-storage-backend"):
        assert needed in server_words
    assert flag(server_words, "--hicache-storage-backend") == "dynamic"
    page_size = int(flag(server_words, "--page-size"))
    assert int(env["KVSTORE_KEYS_CHUNK_SIZE"]) == page_size
    layout = flag(server_words, "--hicache-mem-layout")
    extra = json.loads(flag(server_words, "--hicache-storage-backend-extra-config"))
    # The store's default address (`kvstore serve` with no flags), replaced by the test's store.
    assert extra["target"].startswith("127.0.0.1:") and extra["interface_v1"] == 1

    with ServerProcess(tmp_path, env=env, name="documented") as store:
        extra["target"] = store.target
        pool = host_pool(layout, page_size=page_size, seed=30)
        config = storage_config(store.target, layout=layout)
        config.extra_config = extra  # exactly the documented keys
        backend = open_backend(config, pool)
        try:
            keys = hashes("documented", 2)
            assert backend.batch_set_v1(keys, page_indices(pool, 2)) == [True, True]
            assert backend.batch_exists(keys) == 2
            assert backend.batch_get_v1(keys, page_indices(pool, 2)) == [True, True]
        finally:
            backend.close()
