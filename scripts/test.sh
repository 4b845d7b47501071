#!/usr/bin/env bash
# Set up everything from a fresh clone and run the whole test suite: the one test command.
#
#   bash scripts/test.sh            # lint, type-check, stale-proto check, tests
#   KVSTORE_SKIP_VLLM=1 bash scripts/test.sh   # leave out the real-vLLM suite
#   KVSTORE_SKIP_SLOW=1 bash scripts/test.sh   # leave out the slow suite (long fuzz runs)
#
# Installs redis-server, prometheus and kubectl (apt) if missing, creates .venv with the local CPU
# torch wheel and the package with its test extra, then runs ruff, mypy, the generated-code check
# and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    echo "--- installing redis-server"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v kubectl >/dev/null 2>&1; then
    # Renders the k8s overlays offline. Debian 12 itself has no kubectl package (its
    # kubernetes-client 1.20 predates kustomize components): it comes from an apt source that
    # carries it (pkgs.k8s.io, or Google Cloud's).
    echo "--- installing kubectl"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null || {
        echo "kubectl: no apt source carries it; add https://pkgs.k8s.io (see kubernetes.io/docs/tasks/tools/install-kubectl-linux) and rerun" >&2
        exit 1
    }
fi
# A real Prometheus (and promtool) checks the shipped dashboard and alert rules.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "--- installing prometheus"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi

bash scripts/setup.sh
PY=.venv/bin/python

echo "--- ruff"
.venv/bin/ruff check kvstore kernels tests benchmarks scripts
.venv/bin/ruff format --check kvstore kernels tests benchmarks scripts
echo "--- mypy"
.venv/bin/mypy kvstore kernels
echo "--- generated code"
$PY scripts/gen_proto.py --check
echo "--- pytest"
$PY -m pytest -m "not vllm and not slow" -q -p no:cacheprovider --ignore=tests/vllm
if [ "${KVSTORE_SKIP_SLOW:-0}" != "1" ]; then
    echo "--- slow suite (longer fuzz runs; KVSTORE_SKIP_SLOW=1 leaves it out)"
    $PY -m pytest -m "slow" -q -p no:cacheprovider --ignore=tests/vllm
fi

if [ "${KVSTORE_SKIP_VLLM:-0}" != "1" ]; then
    echo "--- vLLM suite (real engine; KVSTORE_SKIP_VLLM=1 leaves it out)"
    bash scripts/setup-vllm.sh
    KVSTORE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest tests/vllm -q -p no:cacheprovider
fi
