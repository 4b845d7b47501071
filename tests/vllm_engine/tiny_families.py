"""Build the tiny models of the families vLLM groups into several KV cache groups on local disk::

    python tests/vllm_engine/tiny_families.py gpt_oss /tmp/tiny-gpt-oss
    python tests/vllm_engine/tiny_families.py --list

The builder is :mod:`harness.tiny_families`; this script puts ``tests/`` on the path (run by
path, only its own folder is there) and calls it, in a child process of the tests that need the
model, so that torch and transformers stay out of theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.tiny_families import main

if __name__ == "__main__":
    main()
