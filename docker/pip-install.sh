#!/bin/sh
# pip install "$@" inside the image build, looking in a local wheel store first when the build
# is given one (build args, see docker/Dockerfile):
#   PIP_LOCAL_INDEXES  space-separated simple-index URLs (file:///...), tried before PyPI
#   PIP_LOCAL_LINKS    space-separated find-links folders
#   PIP_CERT_FILE      CA bundle for HTTPS (a TLS-intercepting proxy's), mounted into the build
#   TORCH_INDEX_URL    index for torch / torchvision only (e.g. the CPU wheels of download.pytorch.org)
# Without any of them it is a plain `pip install` from PyPI.
set -eu
args=""
if [ -n "${PIP_LOCAL_INDEXES:-}" ]; then
    first=1
    for url in $PIP_LOCAL_INDEXES; do
        if [ "$first" = 1 ]; then args="--index-url $url"; first=0; else args="$args --extra-index-url $url"; fi
    done
    args="$args --extra-index-url ${PIP_UPSTREAM_INDEX:-https://pypi.org/simple}"
fi
for dir in ${PIP_LOCAL_LINKS:-}; do
    args="$args --find-links $dir"
done
if [ -n "${TORCH_INDEX_URL:-}" ] && [ "${EASERVE_TORCH_STEP:-0}" = 1 ]; then
    args="--index-url $TORCH_INDEX_URL --extra-index-url ${PIP_UPSTREAM_INDEX:-https://pypi.org/simple}"
fi
[ -n "${PIP_CERT_FILE:-}" ] && args="$args --cert $PIP_CERT_FILE"
# shellcheck disable=SC2086  # word splitting of $args is intended
exec pip install $args "$@"
