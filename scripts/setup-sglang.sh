#!/usr/bin/env bash
# Create .venv-sglang (if missing): SGLang 0.5.23 on the CPU torch, kvstore and its test extra in
# one environment, without one CUDA wheel. About 4 minutes and 2.8 GB the first time; a venv that
# already has everything is checked and left as it is. Each package pip collects, downloads or
# installs is printed as it happens, so a slow step shows; a failing step prints pip's last lines.
#
#   KVSTORE_SGLANG_VENV=DIR bash scripts/setup-sglang.sh   # use (and install into) DIR instead
#
# This is not an install SGLang supports: its wheel pins torch 2.14.1 and a 373 MB CUDA-only
# sglang-kernel, neither of which a Llama on SGLang's CPU engine needs. The tests run it with the
# CPU stand-ins of tests/harness/sglang_cpu.py. Every version is pinned exactly.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSTORE_SGLANG_VENV:-.venv-sglang}"
SGLANG=0.5.23
TORCH=2.13.0
TORCHVISION=0.28.0
started=$SECONDS
step() { echo "--- [$1/6] +$((SECONDS - started))s $2"; }

log="$(mktemp "${TMPDIR:-/tmp}/kvstore-setup-sglang.XXXXXX")"
constraints="$(mktemp "${TMPDIR:-/tmp}/kvstore-setup-sglang-constraints.XXXXXX")"
trap 'rm -f "$log" "$constraints"' EXIT
# Whatever a step installs, torch stays the local CPU wheel: an unpinned or 2.14.1 torch would
# pull a multi-GB CUDA build.
echo "torch==$TORCH" >"$constraints"

# pip with progress lines; on failure its last lines and the step's exit status.
pip_step() {
    set +e
    "$VENV/bin/pip" install --disable-pip-version-check --progress-bar off "$@" 2>&1 | tee "$log" \
        | grep --line-buffered -E '^ *(Collecting|Downloading|Building|Installing|Successfully)' \
        | while read -r line; do echo "    +$((SECONDS - started))s $line"; done
    local status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -ne 0 ]; then
        echo "setup-sglang.sh: FAILED: pip install $* exited $status; its last lines:" >&2
        tail -n 30 "$log" >&2
        exit "$status"
    fi
}

# What pip has installed, as NAME==VERSION lines (lower-case names), for the idempotence checks.
installed() { "$VENV/bin/pip" list --disable-pip-version-check --format=freeze 2>/dev/null | tr 'A-Z_' 'a-z-'; }
has() { installed | grep -qx "$(echo "$1" | tr 'A-Z_' 'a-z-')"; }

step 1 "creating $VENV"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
else
    echo "    $VENV exists: installing only what it lacks"
fi

# torch first, on its own: every later step is constrained to this very wheel.
step 2 "torch $TORCH (the local CPU wheel)"
if has "torch==$TORCH+cpu" || has "torch==$TORCH"; then
    echo "    torch $TORCH already installed"
else
    pip_step "torch==$TORCH"
fi

# sglang's own requirement list cannot be installed (CUDA wheels, torch 2.14.1): this is the part
# of it that importing and serving a Llama on the CPU engine needs, pinned exactly.
step 3 "the import-time subset of sglang $SGLANG's requirements (scripts/sglang-cpu-requirements.txt)"
missing="$(grep -vE '^\s*(#|$)' scripts/sglang-cpu-requirements.txt | tr 'A-Z_' 'a-z-' \
    | grep -vxFf <(installed) || true)"
if [ -z "$missing" ]; then
    echo "    all $(grep -cvE '^\s*(#|$)' scripts/sglang-cpu-requirements.txt) pins already installed"
else
    pip_step -c "$constraints" -r scripts/sglang-cpu-requirements.txt
fi

# --no-deps: with its dependencies sglang would replace torch and pull the CUDA wheels. torchvision
# is imported by transformers and sglang's multimodal code; its CUDA-only operator registrations
# do not load on the CPU torch and are skipped by the stand-ins.
step 4 "sglang $SGLANG and torchvision $TORCHVISION without their dependencies"
if has "sglang==$SGLANG" && has "torchvision==$TORCHVISION"; then
    echo "    sglang $SGLANG and torchvision $TORCHVISION already installed"
else
    pip_step --no-deps "sglang==$SGLANG" "torchvision==$TORCHVISION"
fi

# kvstore itself (editable) with its test extra, under the same torch constraint; again only when
# pyproject.toml changed since the last install (its hash is kept in the venv, as setup.sh does).
step 5 "kvstore[test] (editable) into $VENV"
stamp="$VENV/.kvstore-pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "    up to date with pyproject.toml (no reinstall)"
else
    pip_step -q -c "$constraints" -e '.[test]'
    echo "$want" >"$stamp"
fi

# The CPU stand-ins have to be in place before sglang loads (tests/harness/sglang_cpu.py).
step 6 "checking that sglang and kvstore import (with the CPU stand-ins)"
PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -c "
from harness import sglang_cpu
sglang_cpu.install()
import sglang, torch, kvstore
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
print('sglang', sglang.__version__, 'torch', torch.__version__, 'kvstore', kvstore.__version__)"
echo "setup-sglang.sh: $VENV ready in $((SECONDS - started))s"
