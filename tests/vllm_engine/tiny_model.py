"""Build the suite's tiny random-weight Llama on local disk::

    python tests/vllm_engine/tiny_model.py /tmp/tiny-llama            # defaults below
    python tests/vllm_engine/tiny_model.py /tmp/big --hidden 1024 --layers 8

The builder is :mod:`harness.tiny_model`; this script puts ``tests/`` on the path (run by
path, only its own folder is there) and calls it, in a child process of the tests that need the
model, so that torch and transformers stay out of theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.tiny_model import main

if __name__ == "__main__":
    main()
