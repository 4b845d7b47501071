"""One vLLM engine with the kvstore connector and KV events on, driven line by line.

    python tests/vllm_engine/events_engine.py --model DIR --target HOST:PORT \\
        --events tcp://*:PORT [--chunk-size N]

After start-up it prints ``READY``; then for each line of token ids (JSON) on stdin it generates
one token and prints ``RESULT {"num_cached_tokens": N}``. The connector's scheduler logs its
namespace on the same stdout (``namespace Namespace(...)``), which a test reads to name chunks
as the connector does. Used by ``tests/vllm_engine/test_engine_events.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Run by path, only this file's folder is on the path: the shared parts are tests/harness/'s.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.vllm_engine_config import configure_logging, kv_transfer_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--events", required=True, help="vLLM's kv events endpoint (bind)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    configure_logging(Path(args.workdir) / "events_engine.logging.json", "INFO")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    connector = argparse.Namespace(
        connector="kvstore",
        target=args.target,
        chunk_size=args.chunk_size,
        timeout_s=5.0,
        load_policy="",  # the connector's default
    )
    transfer = kv_transfer_config(connector)
    assert transfer is not None
    # The node starts after the engine (it needs the namespace the connector logs): the
    # connector's first calls fail, and it should retry soon after, not in 5 s.
    transfer["kv_connector_extra_config"]["retry_after_s"] = 0.5
    llm = LLM(
        model=args.model,
        max_model_len=2048,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=transfer,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": args.events,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    print("READY", flush=True)
    for line in sys.stdin:
        tokens = json.loads(line)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        print("RESULT " + json.dumps({"num_cached_tokens": out.num_cached_tokens}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
