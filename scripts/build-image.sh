#!/usr/bin/env bash
# Build the EAServe image (docker/Dockerfile) with podman or docker:
#
#   scripts/build-image.sh                                   # easerve:latest on python:3.11-slim
#   BASE=localhost/debian-base:bookworm scripts/build-image.sh   # offline: scripts/build-base-image.sh
#
# With podman, the local wheel stores this machine's pip is configured with (`pip config list`:
# find-links folders and file:// indexes) are mounted read-only into the build and looked in
# before PyPI, so torch's CUDA wheels are not downloaded again, and pip's CA bundle (`cert`)
# is used for PyPI (LOCAL_WHEELS=0 turns all of it off).
# Environment: ENGINE, IMAGE (easerve:latest), BASE, PYTHON (the python whose pip config is read),
# TORCH_INDEX_URL; extra arguments go to `<engine> build`.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
IMAGE=${IMAGE:-easerve:latest}
BASE=${BASE:-python:3.11-slim-bookworm}
PYTHON=${PYTHON:-python3}
say() { echo "build-image: $*" >&2; }

args=(-f docker/Dockerfile -t "$IMAGE" --build-arg "BASE=$BASE" --network host)
[ -n "${TORCH_INDEX_URL:-}" ] && args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

if [ "$ENGINE" = podman ] && [ "${LOCAL_WHEELS:-1}" = 1 ]; then
    config=$("$PYTHON" -m pip config list 2>/dev/null || true)
    value() { sed -nE "s/^[^=]*\.$1='(.*)'$/\1/p" <<<"$config" | tr ' ' '\n' | awk 'NF && !seen[$0]++' | tr '\n' ' '; }
    indexes="" links="" mounts=()
    for url in $(value extra-index-url) $(value index-url); do
        [[ $url == file://* ]] || continue
        indexes+="$url "
    done
    for dir in $(value find-links); do links+="$dir "; done
    declare -A seen=()
    for path in $indexes $links; do
        path=${path#file://}; path=${path%/simple}; path=${path%/}
        [ -d "$path" ] && [ -z "${seen[$path]:-}" ] || continue
        seen[$path]=1
        mounts+=(-v "$path:$path:ro")
    done
    cert=$(value cert); cert=${cert% }
    if [ -n "$cert" ] && [ -f "$cert" ]; then  # a TLS-intercepting proxy's CA bundle, for PyPI
        mounts+=(-v "$cert:/run/easerve-pip-cert.pem:ro")
        args+=(--build-arg "PIP_CERT_FILE=/run/easerve-pip-cert.pem")
    fi
    if [ ${#mounts[@]} -gt 0 ]; then
        say "local wheel stores: ${indexes}${links}"
        args+=("${mounts[@]}" --build-arg "PIP_LOCAL_INDEXES=${indexes% }" --build-arg "PIP_LOCAL_LINKS=${links% }")
    fi
fi

start=$(date +%s)
say "$ENGINE build ${args[*]} $* ."
"$ENGINE" build "${args[@]}" "$@" .
say "built $IMAGE in $(( $(date +%s) - start )) s"
