#!/usr/bin/env bash
# Fetch, on this machine, the wheels that the GPU machine lacks, into .whl/ (ignored by git), for
# scripts/gpu-verify.sh to install there. That machine (the device tool's H100 or H200) has
# Python 3.12 with torch, Triton, transformers, numpy, xxhash, aiofiles, prometheus-client,
# protobuf 7.36, pytest and pytest-timeout, grpcio 1.84 (older than the generated code needs),
# reaches no package registry, and receives at most 64 MiB: the working tree and these wheels.
#
#   bash scripts/gpu-wheels.sh                    # what kvstore and its tests need beyond that
#   bash scripts/gpu-wheels.sh --ucx              # plus ucxx built for CUDA 13 (~28 MB more)
#   bash scripts/gpu-wheels.sh --ucx --skip grpcio  # leave out a wheel the machine already has
#
# The first set is about 9 MB; with --ucx, about 37 MB (UCX's wheel slimmed to what runs). The script checks the sum and says when it is over; then leave out grpcio where the
# machine's own is 1.85.1 or newer (gpu-verify.sh prints its version in summary.txt). Versions
# are pinned to those the CPU suite runs.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=(
    "lmdb==3.0.0"
    "redis==8.1.0"
    "grpcio==1.85.3"
    "grpcio-health-checking==1.85.1"
    "pytest-asyncio==1.5.0"
    "blake3==1.0.11"
)
# ucxx for CUDA 13 (the machine's CUDA) and what it needs beyond the image (which has cuda-core,
# cuda-bindings and nvidia-ml-py). libucxx-cu13 0.52 wants libucx-cu13 older than 1.22.
UCX=(
    "ucxx-cu13==0.52.0"
    "libucxx-cu13==0.52.0"
    "libucx-cu13==1.21.0"
    "rmm-cu13==26.10.0"
    "librmm-cu13==26.10.0"
    "rapids-logger==0.3.0"
)
LIMIT=$((64 * 1024 * 1024))

wanted=("${BASE[@]}")
skip=()
while [ $# -gt 0 ]; do
    case "$1" in
        --ucx) wanted+=("${UCX[@]}") ;;
        --skip)
            [ $# -ge 2 ] || { echo "--skip needs a package name, e.g. --skip grpcio" >&2; exit 2; }
            skip+=("$2")
            shift
            ;;
        *)
            echo "unknown argument '$1'; allowed: --ucx, --skip NAME" >&2
            exit 2
            ;;
    esac
    shift
done

rm -rf .whl
mkdir -p .whl
for spec in "${wanted[@]}"; do
    name="${spec%%==*}"
    for left_out in "${skip[@]+"${skip[@]}"}"; do
        [ "$name" = "$left_out" ] && continue 2
    done
    echo "--- $spec"
    # Every manylinux level the wheels above are published for; pip matches the level exactly.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$spec" 2>&1 \
        | { grep -v "^WARNING: Location" || true; }
done

# UCX's own wheel is 40 MB, mostly what kvstore never runs there: static archives, the
# command-line tools and the perf-test plugins. Dropping them leaves 17 MB and every shared
# library UCX loads (each under all of its names).
for wheel in .whl/libucx_cu*.whl; do
    [ -e "$wheel" ] || continue
    python3 scripts/slim_wheel.py "$wheel" '\.a$|/bin/|perftest'
done

wheels=0
if compgen -G ".whl/*.whl" >/dev/null; then
    wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
fi
# What travels beside the wheels: tracked and untracked-not-ignored files (a tracked file deleted
# from disk makes du complain; it does not travel, so it does not count).
listed() { git ls-files -z --cached --others --exclude-standard; }
tree=$({ listed | xargs -0 du -cb 2>/dev/null || true; } \
    | awk '$2 == "total" { sum += $1 } END { print sum + 0 }')
total=$((wheels + tree))
echo "--- .whl: $((wheels / 1024)) KiB of wheels; with the working tree $((total / 1024)) KiB" \
    "of the device's $((LIMIT / 1024)) KiB"
if [ "$total" -gt "$LIMIT" ]; then
    echo "too large to carry to the GPU machine: leave out what it already has (--skip grpcio" \
        "where summary.txt shows grpcio 1.85.1 or newer there)" >&2
    exit 1
fi
