#!/usr/bin/env bash
# Create .venv (if missing) and install kvstore with its test extra.
# torch is pinned to 2.13.0, the CPU wheel pip finds on local disk; an unpinned torch would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
echo "--- installing into .venv"
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,ucx,bench]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvstore, torch, lmdb, grpc; print('kvstore', kvstore.__version__, 'torch', torch.__version__)"
