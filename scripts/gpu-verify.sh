#!/usr/bin/env bash
# Run every CUDA check kvstore has, on a machine with a CUDA device, and keep what they print.
#
#   bash scripts/gpu-verify.sh                   # tests, harness and bench (the default)
#   bash scripts/gpu-verify.sh tests harness     # only the steps named
#
# Steps, in this order, each under its own time limit so that one hang cannot eat the others'
# (540 s together at worst, inside one device call's 600; a passing run took about 3 minutes on
# an H100; KVSTORE_GPU_{HARNESS,TESTS,BENCH}_S change them):
#   harness  tests/gpu_harness.py on every cache layout over shared memory, and over UCX where
#            ucxx imports (loads into CUDA tensors, bit for bit)
#   tests    every `gpu`-marked test (pytest -m gpu on the modules that hold them)
#   bench    benchmarks/bench_gpu.py (loads and saves against the link and against prefill, for
#            two model shapes; its table is appended to summary.txt)
#
# Wheels in .whl/ (scripts/gpu-wheels.sh fetches them; KVSTORE_GPU_WHEELS names another folder)
# are installed first into a directory of their own, put ahead of the machine's packages on
# PYTHONPATH; the checkout itself is imported from where it lies. Results go to $OUT (the device
# tool's folder that comes back), else to ./gpu-verify-out: summary.txt (each step's exit status
# and the machine), harness.log, pytest.log, bench.log, gpu.json and gpu.md. The exit status is 0
# only when every step passed.
#
# Without a CUDA device it exits 2 before doing anything, unless KVSTORE_GPU_VERIFY_DEVICE=cpu
# asks for a rehearsal: the same steps on the CPU, where the gpu tests skip and the benchmark
# runs its --rehearse (tests/project/test_gpu_verify_script.py runs that rehearsal, so the
# script cannot rot here).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu-verify-out}"
SITE="${KVSTORE_GPU_SITE:-/tmp/kvstore-gpu-site}"
WHEELS="${KVSTORE_GPU_WHEELS:-.whl}"
DEVICE="${KVSTORE_GPU_VERIFY_DEVICE:-cuda}"
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(harness tests bench)
for step in "${STEPS[@]}"; do
    case "$step" in
        harness | tests | bench) ;;
        *)
            echo "unknown step '$step'; allowed: harness, tests, bench" >&2
            exit 2
            ;;
    esac
done
case "$DEVICE" in
    cuda | cpu) ;;
    *)
        echo "KVSTORE_GPU_VERIFY_DEVICE='$DEVICE';" \
            "allowed: cuda (the default), cpu (a rehearsal)" >&2
        exit 2
        ;;
esac

mkdir -p "$OUT" "$SITE"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "--- installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || {
        say "installing the wheels in $WHEELS/ failed"
        exit 1
    }
fi
# kernels/ is imported as kvstore_kernels (pyproject's package-dir); no install step needed.
ln -sfn "$PWD/kernels" "$SITE/kvstore_kernels"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF' | tee -a "$SUMMARY"
import importlib.metadata as md, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    from kvstore.client.cuda_runtime import CudaRuntimeUnavailable, cuda_runtime
    try:
        print(f"CUDA runtime for direct copies: {cuda_runtime().path}")
    except CudaRuntimeUnavailable as exc:
        print(f"no direct copies: {exc}")
for name in ("grpcio", "protobuf", "pytest", "triton", "ucxx-cu13", "ucxx-cu12"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} absent")
EOF
# Triton builds a C launcher on first use: without a compiler or Python's headers the kernels
# fall back to the torch reference (the logs say so), and the figures are the reference's.
compiler=$( (cc --version 2>/dev/null || echo absent) | head -n 1)
headers=$("$PY" -c 'import os, sysconfig
print("present" if os.path.exists(sysconfig.get_paths()["include"] + "/Python.h") else "absent")')
say "C compiler: $compiler; Python.h: $headers"
has_cuda='import sys, torch; sys.exit(not torch.cuda.is_available())'
if [ "$DEVICE" = cuda ] && ! "$PY" -c "$has_cuda"; then
    say "no CUDA device here; KVSTORE_GPU_VERIFY_DEVICE=cpu runs the steps as a rehearsal"
    exit 2
fi
has_ucx='import sys; from kvstore.protocol.ucx import ucx_unavailable_reason as r
sys.exit(r() is not None)'
if "$PY" -c "$has_ucx"; then
    UCX=1
else
    UCX=0
    # The UCX test modules refuse to be collected without ucxx unless told it is expected.
    export KVSTORE_SKIP_UCX=1
    say "ucxx does not import: the UCX cases are not run (scripts/gpu-wheels.sh --ucx carries it)"
fi

failed=0
# run NAME LIMIT_S LOG COMMAND...: one step under its time limit, its status in the summary.
run() {
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "--- $name (at most ${limit}s): $*" | tee -a "$log"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    local status=$?
    say "$name: exit $status after $((SECONDS - started))s"
    [ "$status" -eq 0 ] || failed=1
    return 0
}

for step in "${STEPS[@]}"; do
    case "$step" in
        harness)
            run "harness shm" "${KVSTORE_GPU_HARNESS_S:-75}" "$OUT/harness.log" \
                "$PY" tests/gpu_harness.py --device "$DEVICE"
            if [ "$UCX" = 1 ]; then
                run "harness ucx" "${KVSTORE_GPU_HARNESS_S:-75}" "$OUT/harness.log" \
                    "$PY" tests/gpu_harness.py --device "$DEVICE" --data-plane ucx
            fi
            grep -E "^(OK|FAIL) " "$OUT/harness.log" >>"$SUMMARY"
            ;;
        tests)
            mapfile -t modules < <(grep -rlE "pytest\.mark\.gpu\b" tests --include='test_*.py')
            run "pytest -m gpu" "${KVSTORE_GPU_TESTS_S:-210}" "$OUT/pytest.log" \
                "$PY" -m pytest -m gpu -rA -p no:cacheprovider "${modules[@]}"
            tail -n 1 "$OUT/pytest.log" >>"$SUMMARY"
            ;;
        bench)
            rehearse=()
            [ "$DEVICE" = cpu ] && rehearse=(--rehearse)
            run "bench_gpu" "${KVSTORE_GPU_BENCH_S:-180}" "$OUT/bench.log" \
                "$PY" benchmarks/bench_gpu.py --out "$OUT/gpu" "${rehearse[@]+"${rehearse[@]}"}"
            [ -f "$OUT/gpu.md" ] && cat "$OUT/gpu.md" >>"$SUMMARY"
            ;;
    esac
done
say "verdict: $([ "$failed" -eq 0 ] && echo 'every step passed' || echo 'a step failed')"
exit "$failed"
