#!/usr/bin/env bash
# Build the tiny random-weight Llama the vLLM tests use (tests/vllm_engine/tiny_model.py), in DIR
# (default: ./tiny-llama), with .venv-vllm's python (scripts/setup-vllm.sh builds it). It needs
# no download: a fixed seed makes the weights, a WordLevel tokenizer of words t0 ... t1023 the
# vocabulary. A directory already built the same way is reused. Then it prints how to serve it.
#
#   bash scripts/tiny-model.sh [DIR]
#   KVSTORE_VLLM_VENV=DIR bash scripts/tiny-model.sh   # another vLLM environment
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVSTORE_VLLM_VENV:-$root/.venv-vllm}"
out="${1:-tiny-llama}"
[ -x "$VENV/bin/python" ] || {
    echo "tiny-model.sh: FAILED: no $VENV/bin/python; run bash scripts/setup-vllm.sh first" >&2
    exit 1
}
echo "--- building the tiny Llama in $out (about a minute, most of it importing torch)"
HF_HUB_OFFLINE=1 "$VENV/bin/python" "$root/tests/vllm_engine/tiny_model.py" "$out"
out="$(cd "$out" && pwd)"
echo "tiny-model.sh: built $out; serve it with the README's vLLM command, --model $out"
