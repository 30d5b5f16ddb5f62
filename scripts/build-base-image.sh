#!/usr/bin/env bash
# Build a local Debian base image for docker/Dockerfile on machines that reach no container
# registry (only Debian's package mirror):
#
#   scripts/build-base-image.sh                 # -> localhost/debian-base:bookworm
#   podman build --build-arg BASE=localhost/debian-base:bookworm -f docker/Dockerfile .
#
# debootstrap (minbase + python3, python3-venv, ca-certificates) into a temporary root, then
# `tar | podman import`. Idempotent: an existing image is kept (FORCE=1 rebuilds it).
# Environment: ENGINE (podman, else docker), IMAGE, SUITE (bookworm), DEBIAN_MIRROR (default:
# the first Debian URI apt is configured with, else http://deb.debian.org/debian).
set -euo pipefail

ENGINE=${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
SUITE=${SUITE:-bookworm}
IMAGE=${IMAGE:-localhost/debian-base:$SUITE}
PACKAGES=python3,python3-venv,ca-certificates

say() { echo "build-base-image: $*" >&2; }

apt_mirror() {
    local uri
    uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
            /etc/apt/sources.list 2>/dev/null | grep -v security | head -n1 |
          sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//; s/[[:space:]].*$//')
    echo "${uri:-http://deb.debian.org/debian}"
}

if [ "${FORCE:-0}" != 1 ] && "$ENGINE" image inspect "$IMAGE" >/dev/null 2>&1; then
    say "$IMAGE exists already ($ENGINE); kept it (FORCE=1 rebuilds)"
    exit 0
fi
command -v debootstrap >/dev/null || { say "debootstrap is missing: apt-get install debootstrap"; exit 1; }
[ "$(id -u)" = 0 ] || { say "debootstrap needs root"; exit 1; }

MIRROR=${DEBIAN_MIRROR:-$(apt_mirror)}
ROOT=$(mktemp -d /tmp/debian-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
say "debootstrap --variant=minbase --include=$PACKAGES $SUITE $ROOT $MIRROR"
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 ||
    { tail -n 20 "$ROOT.log" >&2; rm -f "$ROOT.log"; say "debootstrap failed"; exit 1; }
rm -f "$ROOT.log"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
tar -C "$ROOT" -c . | "$ENGINE" import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
say "built $IMAGE with $ENGINE in $(( $(date +%s) - start )) s ($(du -sh "$ROOT" | cut -f1) root file system)"
