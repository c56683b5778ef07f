#!/usr/bin/env bash
# Builds the tandem:dev image here, without a container registry: the base image is made from
# Debian packages (mmdebstrap) and imported into podman, then the Dockerfile is built on it.
#
#   deploy/build-image.sh            builds localhost/tandem-base:bookworm once, then tandem:dev
#   TAG=tandem:0.1.0 deploy/build-image.sh
#   TARGET=audit TAG=tandem:audit deploy/build-image.sh    the audit's image (PySpark, Java)
#
# Needs root (or rootless podman set up) and the Debian and PyPI package mirrors. Installs
# podman, runc and mmdebstrap with apt when they are missing. Containers run with runc and host
# networking; containers.conf gets `default_ulimits = []` (the default ulimits fail here).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${TAG:-tandem:dev}
TARGET=${TARGET:-tandem}
SUITE=${SUITE:-bookworm}
BASE=localhost/tandem-base:$SUITE

need=()
command -v podman >/dev/null || need+=(podman)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v runc >/dev/null || need+=(runc)
if ((${#need[@]})); then
    echo "installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${need[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
fi

conf=/etc/containers/containers.conf
if ! grep -qs '^default_ulimits *= *\[\]' "$conf"; then
    mkdir -p "$(dirname "$conf")"
    if grep -qs '^\[containers\]' "$conf"; then
        sed -i 's/^\[containers\]/[containers]\ndefault_ulimits = []/' "$conf"
    else
        printf '[containers]\ndefault_ulimits = []\n' >>"$conf"
    fi
fi

if ! podman image exists "$BASE"; then
    echo "making $BASE from Debian $SUITE packages" >&2
    mmdebstrap --quiet --variant=minbase \
        --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/{doc,man,locale}/*' \
        "$SUITE" - | podman import --quiet - "$BASE" >/dev/null
fi

# The build's downloads trust what this machine trusts (a proxy's CA, say); the image keeps
# Debian's own bundle.
trust=()
if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    trust=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
podman build --quiet --runtime runc --network host "${trust[@]}" --build-arg "BASE=$BASE" \
    --target "$TARGET" -t "$TAG" . >/dev/null
echo "built $TAG on $BASE" >&2
echo "$TAG"
