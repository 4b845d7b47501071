#!/usr/bin/env bash
# Create .venv (if missing) and install kvstore with its test, ucx and bench extras, but only when
# pyproject.toml changed since the last install (its hash is kept in the venv).
#
#   KVSTORE_VENV=DIR bash scripts/setup.sh   # another environment than .venv
#
# torch is pinned to 2.13.0, the CPU wheel pip finds on local disk; an unpinned torch would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSTORE_VENV:-.venv}"
STAMP="$VENV/.kvstore-pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "--- creating $VENV (first run: installing takes a minute or two)"
    python3 -m venv "$VENV"
elif [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "--- $VENV is up to date with pyproject.toml (no reinstall)"
    exit 0
elif [ -f "$STAMP" ]; then
    echo "--- pyproject.toml changed since $VENV was installed: reinstalling"
else
    echo "--- $VENV has no install record: installing"
fi

# pip's own failure must stop the script (pipefail); the filter only hides a harmless warning.
quiet() { grep -v "^WARNING: Location" || true; }
# The distribution was called `kvstore` before (a name that belongs to another PyPI package):
# an environment installed then holds it under that name.
"$VENV/bin/pip" uninstall -q -y kvstore >/dev/null 2>&1 || true
echo "--- installing torch 2.13.0 (CPU) into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 2>&1 | quiet
echo "--- installing kvstore with the test, ucx and bench extras into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -e '.[test,ucx,bench]' 2>&1 | quiet
"$VENV/bin/python" -c "import kvstore, torch, lmdb, grpc; print('kvstore', kvstore.__version__, 'torch', torch.__version__)"
echo "$want" >"$STAMP"
