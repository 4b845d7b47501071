#!/usr/bin/env bash
# Start kvstore on its embedded defaults (dram + nvme under ~/.local/share/kvstore), run the demo
# client against it (it prints what it stored and read back), then stop the server gracefully.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
.venv/bin/kvstore serve &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
.venv/bin/kvstore demo --wait 30
.venv/bin/kvstore stats
