#!/bin/sh
# A local stand-in for python:3.11-slim, for hosts that reach Debian's packages but no image
# registry: Debian 12 (bookworm ships Python 3.11) bootstrapped with debootstrap, imported as
# an image. Then build the image on it:
#
#   sudo docker/base-image.sh                 # -> mmsched-base:bookworm
#   make image BASE_IMAGE=mmsched-base:bookworm TORCH_WHEELS=/path/to/wheels
#
# Needs root and debootstrap (apt-get install debootstrap). ENGINE: docker or podman
# (default: the one `make image` would use). DEBIAN_MIRROR: a mirror other than debootstrap's.
set -eu
tag=${1:-mmsched-base:bookworm}
if [ -z "${ENGINE:-}" ]; then
    if docker info >/dev/null 2>&1; then ENGINE=docker
    elif command -v podman >/dev/null 2>&1; then ENGINE=podman
    else echo "base-image.sh: no docker daemon and no podman (apt-get install podman)" >&2; exit 1
    fi
fi
command -v debootstrap >/dev/null || { echo "base-image.sh: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d /var/tmp/mmsched-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
# shellcheck disable=SC2086  # an unset DEBIAN_MIRROR is no argument at all
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" ${DEBIAN_MIRROR:-}
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$ENGINE" import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag"
echo "base-image.sh: built $tag"
