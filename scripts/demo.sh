#!/usr/bin/env bash
# Start kvstore on its embedded defaults (dram + nvme) on a free loopback port, with a temporary
# data directory of its own (so a server of yours on the default one is left alone), check that
# the process answering there is the one this script started, run the demo client against it (it
# prints what it stored and read back), then stop the server gracefully and remove the directory.
#
#   KVSTORE_VENV=DIR bash scripts/demo.sh   # use (and install into) DIR instead of .venv
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSTORE_VENV:-.venv}"
fail() { echo "demo.sh: FAILED: $*" >&2; exit 1; }

bash scripts/setup.sh

log="$(mktemp "${TMPDIR:-/tmp}/kvstore-demo-log.XXXXXX")"
data="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-demo-data.XXXXXX")"
server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
    rm -f "$log"
    rm -rf "$data"
}
trap cleanup EXIT

# Port 0: the kernel picks a free port, so another server (say one on 50051) is never reused.
echo "--- starting kvstore serve on a free loopback port, data in $data (removed at the end)"
"$VENV/bin/kvstore" serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --nvme-path "$data" >"$log" 2>&1 &
server=$!
address=""
for _ in $(seq 1 600); do
    address="$(sed -n 's/^kvstore serving on \([0-9.]*:[0-9]*\)$/\1/p' "$log" | head -n 1)"
    [ -n "$address" ] && break
    if ! kill -0 "$server" 2>/dev/null; then
        cat "$log" >&2
        fail "kvstore serve (pid $server) exited before serving"
    fi
    sleep 0.1
done
[ -n "$address" ] || { cat "$log" >&2; fail "kvstore serve (pid $server) printed no address in 60 s"; }

# The listening socket on that port must belong to our server process, nobody else's.
"$VENV/bin/python" - "$server" "${address##*:}" <<'PY' || fail "the server at $address is not pid $server"
import os
import sys

pid, port = sys.argv[1], int(sys.argv[2])
inodes = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        lines = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        fields = line.split()
        # local address HEXIP:HEXPORT, state 0A = LISTEN, inode
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
            inodes.add(fields[9])
owned = set()
for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
        owned.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        pass
sys.exit(0 if inodes and all(f"socket:[{i}]" in owned for i in inodes) else 1)
PY
echo "--- kvstore serve (pid $server) is serving on $address"

"$VENV/bin/kvstore" demo --target "$address" --wait 30 || fail "kvstore demo against $address"
"$VENV/bin/kvstore" stats --target "$address" || fail "kvstore stats against $address"
kill -0 "$server" 2>/dev/null || fail "kvstore serve (pid $server) died during the demo"
echo "demo.sh: demo OK against its own server (pid $server, $address)"
