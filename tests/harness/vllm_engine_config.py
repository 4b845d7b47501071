"""How the vLLM suite's engine scripts configure an engine: the ``kv_transfer_config`` of the
chosen connector, and a logging config that makes every engine process print the connector's
lines. Shared by ``tests/vllm_engine/engine_runner.py`` and ``tests/vllm_engine/events_engine.py``.
"""

from __future__ import annotations

import argparse
import json
import logging.config
import os
from pathlib import Path
from typing import Any

__all__ = ["configure_logging", "kv_transfer_config"]


def kv_transfer_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` for the chosen connector, or ``None`` for none."""
    if args.connector == "none":
        return None
    if args.connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.storage_path},
        }
    extra: dict[str, Any] = {"target": args.target, "timeout_s": args.timeout_s}
    if args.chunk_size:  # 0: the store's (its node's keys.chunk_size)
        extra["chunk_size"] = args.chunk_size
    if args.load_policy:
        extra["load_policy"] = args.load_policy
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def configure_logging(path: Path, kvstore_level: str) -> None:
    """Make every engine process (they are spawned) log vLLM's and the connector's records.

    vLLM configures only its own logger, in each process, from ``VLLM_LOGGING_CONFIG_PATH``;
    a config naming the ``kvstore`` logger too is the one way to see the connector's lines.
    """
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ:
        return
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"}
        },
        "handlers": {"plain": handler},
        "loggers": {
            "vllm": {"handlers": ["plain"], "level": "INFO", "propagate": False},
            "kvstore": {"handlers": ["plain"], "level": kvstore_level, "propagate": False},
        },
    }
    path.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    logging.config.dictConfig(config)
