"""Real vLLM engines, each in its own process: ``tests/vllm_engine/engine_runner.py`` over a
prompts file, its results read back as JSON.

Every engine is its own subprocess, as separate replicas would be; greedy sampling with
``ignore_eos`` keeps outputs deterministic and :data:`MAX_TOKENS` long. Used by the end-to-end
tests of the vLLM suite (``tests/vllm_engine/``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

__all__ = ["CHUNK", "ENGINE_TIMEOUT_S", "MAX_TOKENS", "RUNNER", "Engine"]

#: The script each engine runs.
RUNNER = Path(__file__).resolve().parents[1] / "vllm_engine" / "engine_runner.py"
#: Tokens per chunk, as the engines' connectors are told.
CHUNK = 256
ENGINE_TIMEOUT_S = 240
MAX_TOKENS = 12


class Engine:
    """One ``tests/vllm_engine/engine_runner.py`` subprocess over ``prompts``, with ``args`` added
    to its command line (the connector's flags, say) and ``env`` to its environment;
    :meth:`result` waits (up to ``timeout_s``) for its JSON output."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        model: Path,
        prompts: list[list[int]],
        *args: str,
        max_tokens: int = MAX_TOKENS,
        timeout_s: float = ENGINE_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.out = workdir / f"{name}.json"
        self.log = workdir / f"{name}.log"
        self.timeout_s = timeout_s
        prompts_file = workdir / f"{name}.prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        command = [
            sys.executable,
            str(RUNNER),
            "--model",
            str(model),
            "--prompts",
            str(prompts_file),
            "--out",
            str(self.out),
            "--max-tokens",
            str(max_tokens),
            "--chunk-size",
            str(CHUNK),
            "--max-model-len",
            "2048",
            *args,
        ]
        self.started = time.monotonic()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
            )

    def result(self) -> dict[str, Any]:
        """Wait for the engine (bounded) and return its JSON output."""
        try:
            code = self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"engine {self.name} hung for {self.timeout_s:.0f} s:\n{self._tail()}")
        self.elapsed = time.monotonic() - self.started
        if code != 0 or not self.out.exists():
            pytest.fail(f"engine {self.name} exited with {code}:\n{self._tail()}")
        data: dict[str, Any] = json.loads(self.out.read_text())
        return data

    def _tail(self) -> str:
        """The last lines of the engine's log, for a failure's message."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
