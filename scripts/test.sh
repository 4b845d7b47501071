#!/usr/bin/env bash
# Set up everything from a fresh clone and run the whole test suite: the one test command.
#
#   bash scripts/test.sh            # lint, type-check, stale generated code check, tests
#   KVSTORE_SKIP_VLLM=1 bash scripts/test.sh   # leave out the real-vLLM suite
#   KVSTORE_SKIP_SGLANG=1 bash scripts/test.sh   # leave out the real-SGLang suite
#   KVSTORE_SKIP_SLOW=1 bash scripts/test.sh   # leave out the slow suite (long fuzz runs)
#   KVSTORE_TEST_WORKERS=0 bash scripts/test.sh   # the default suite in one process (default: 2)
#   KVSTORE_TEST_DRY_RUN=1 bash scripts/test.sh   # list the suites and their commands, run nothing
#
# Installs redis-server, prometheus, kubectl, g++ and libssl-dev (apt) if missing, creates .venv
# with the local CPU torch wheel and the package with its test extra (a failure there stops the
# run: no suite could pass without it). Then every suite runs, whatever the ones before it did:
# ruff, ruff format, mypy, the generated-code check, pytest, the slow suite, the vLLM suite, the
# SGLang suite. Each prints one result line (`--- NAME: ok (12s)`, `--- NAME: FAILED (exit 1,
# 30s)`, `--- NAME: skipped (why)`), and a summary at the end lists them all (scripts/suites.sh);
# the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/suites.sh

setup() {
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
    # SGLang compiles a C++ hash extension at its first request (the SGLang suite's engines):
    # it needs a C++ compiler and OpenSSL's headers.
    if ! command -v g++ >/dev/null 2>&1 || [ ! -f /usr/include/openssl/sha.h ]; then
        echo "--- installing g++ and libssl-dev"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ libssl-dev >/dev/null
    fi
    bash scripts/setup.sh
}

if [ "${KVSTORE_TEST_DRY_RUN:-0}" != "1" ]; then
    # In a subshell of its own with -e: the first failing step ends the set-up (and the run).
    (set -e; setup)
    rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "=== set-up failed (exit $rc, see above): no suite ran"
        exit 1
    fi
fi
PY=.venv/bin/python

# What is generated and committed: the protobuf modules and the README's settings table.
generated_code() {
    $PY scripts/gen_proto.py --check && $PY scripts/gen_settings_table.py --check
}

vllm_suite() {
    bash scripts/setup-vllm.sh &&
        KVSTORE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest tests/vllm_engine -q -p no:cacheprovider
}

# .venv-sglang: SGLang 0.5.23 on the CPU torch (about 4 minutes the first time), then the contract
# tier and the engine tier (two SGLang engines on the CPU with kvstore as HiCache storage).
sglang_suite() {
    bash scripts/setup-sglang.sh &&
        KVSTORE_REQUIRE_SGLANG=1 .venv-sglang/bin/python -m pytest tests/sglang_engine -q -p no:cacheprovider
}

# A failing suite fails the run at the end, never stops it: every suite runs.
suite ruff .venv/bin/ruff check kvstore kernels tests benchmarks scripts
suite ruff-format .venv/bin/ruff format --check kvstore kernels tests benchmarks scripts
# mypy (strict) on the package, the kernels, the tests' harness, the connector tests and the two
# engines' suites: the stand-ins those tests hand the connector are checked against the protocols
# they stand in for. (The engines' folders are not named vllm and sglang: mypy would take them
# for the engines themselves.)
suite mypy .venv/bin/mypy kvstore kernels tests/harness tests/integrations tests/vllm_engine \
    tests/sglang_engine
suite generated-code generated_code
# The default suite on KVSTORE_TEST_WORKERS processes (pytest-xdist; 0 runs it in this one): most of
# its time is spent waiting on servers and subprocesses, so two workers on two cores take about half
# as long. A file stays on one worker (--dist loadfile), so its module fixtures are set up once.
suite pytest $PY -m pytest -m "not vllm and not slow" -q -p no:cacheprovider \
    -n "${KVSTORE_TEST_WORKERS:-2}" --dist loadfile --ignore=tests/vllm_engine --ignore=tests/sglang_engine
if [ "${KVSTORE_SKIP_SLOW:-0}" = "1" ]; then
    skip slow "KVSTORE_SKIP_SLOW=1: the longer fuzz runs left out"
else
    suite slow $PY -m pytest -m "slow" -q -p no:cacheprovider --ignore=tests/vllm_engine --ignore=tests/sglang_engine
fi
if [ "${KVSTORE_SKIP_VLLM:-0}" = "1" ]; then
    skip vllm "KVSTORE_SKIP_VLLM=1: the real-vLLM suite left out"
else
    suite vllm vllm_suite
fi
if [ "${KVSTORE_SKIP_SGLANG:-0}" = "1" ]; then
    skip sglang "KVSTORE_SKIP_SGLANG=1: the real-SGLang suite left out"
else
    suite sglang sglang_suite
fi
summary
