#!/usr/bin/env bash
# Build the dgserve image from the repository's one Dockerfile (docs/deployment.md, "Building the image here").
#
#   scripts/build_image.sh [--cuda]      the production image: CUDA devel builder, slim CUDA runtime, the CPU test
#                                        suite in the builder (the Dockerfile's defaults). Needs a registry that
#                                        serves nvidia/cuda; docker when installed, else buildah.
#   scripts/build_image.sh --cpu         a CPU image on a Debian bookworm base built here with mmdebstrap and
#                                        imported with podman (no registry of base images needed), a CPU torch of
#                                        pyproject's pin, a CPU-only dgserve._C; built with buildah --isolation
#                                        chroot. Needs root, buildah, podman and mmdebstrap.
#
# Options: --tag TAG (default dgserve:latest for --cuda, localhost/dgserve:cpu for --cpu), --run-tests / --no-tests
# (the builder's CPU test suite: on for --cuda, off for --cpu by default), --no-cache (rebuild every layer),
# --rebuild-base (--cpu: make the Debian base again).
# Environment (--cpu): PYTHON (python3; its `pip config list` names the find-links folder that holds the CPU torch
# wheel when PIP_FIND_LINKS is unset), CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt: the host's system CA bundle,
# mounted over the image's own during the build so that pip trusts a TLS-intercepting proxy), BASE_IMAGE
# (localhost/dgserve-base:bookworm), DEBIAN_MIRROR (http://deb.debian.org).
# Prints the image's size and the build's seconds last.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=cuda
tag=""
run_tests=""
no_cache=()
rebuild_base=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cpu) mode=cpu ;;
        --cuda) mode=cuda ;;
        --tag)
            tag="$2"
            shift
            ;;
        --run-tests) run_tests=1 ;;
        --no-tests) run_tests=0 ;;
        --no-cache) no_cache=(--no-cache) ;;
        --rebuild-base) rebuild_base=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "build_image.sh: unknown argument $1 (--help)" >&2
            exit 2
            ;;
    esac
    shift
done

start=$(date +%s)

if [[ "$mode" == cuda ]]; then
    tag=${tag:-dgserve:latest}
    args=(--build-arg "RUN_TESTS=${run_tests:-1}" -t "$tag" -f Dockerfile .)
    if command -v docker > /dev/null; then
        docker build ${no_cache[@]+"${no_cache[@]}"} "${args[@]}"
    else
        buildah bud --isolation "${BUILDAH_ISOLATION:-chroot}" --format docker --layers \
            ${no_cache[@]+"${no_cache[@]}"} "${args[@]}"
    fi
    echo "built $tag in $(($(date +%s) - start)) s"
    exit 0
fi

# ---- --cpu
missing=()
for tool in buildah podman mmdebstrap; do
    command -v "$tool" > /dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} -gt 0 || $(id -u) -ne 0 ]]; then
    echo "build_image.sh --cpu needs root and buildah, podman, mmdebstrap (missing: ${missing[*]:-none}; uid $(id -u));" \
        "on Debian: apt-get install podman buildah mmdebstrap runc" >&2
    exit 3
fi

tag=${tag:-localhost/dgserve:cpu}
base=${BASE_IMAGE:-localhost/dgserve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org}
ca_bundle=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
py=${PYTHON:-python3}
torch_version=$(sed -n 's/^ *"torch==\([^"]*\)",.*/\1/p' pyproject.toml)
[[ -n "$torch_version" ]] || {
    echo "build_image.sh: no torch== pin in pyproject.toml" >&2
    exit 2
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $rebuild_base -eq 1 ]] || ! podman image exists "$base"; then
    echo "== base image $base: Debian bookworm minbase with python3, python3-venv, ca-certificates (mmdebstrap)"
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/base.tar" \
        "deb $mirror/debian bookworm main" \
        "deb $mirror/debian bookworm-updates main" \
        "deb $mirror/debian-security bookworm-security main"
    podman import --quiet "$work/base.tar" "$base"
    rm -f "$work/base.tar"
fi

# The CPU torch wheel: in the find-links folders of this machine's pip configuration (or PIP_FIND_LINKS).
find_links=${PIP_FIND_LINKS:-$("$py" -m pip config list 2> /dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | head -n 1)}
mounts=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
wheel_dirs=()
for dir in $find_links; do
    dir=${dir#file://}
    if [[ -d "$dir" ]]; then
        mounts+=(-v "$dir:$dir:ro")
        wheel_dirs+=("$dir")
    fi
done
if ! compgen -G "${wheel_dirs[0]:-/nonexistent}/torch-${torch_version}+cpu-*.whl" > /dev/null; then
    echo "build_image.sh --cpu: no torch-${torch_version}+cpu wheel in the find-links folders (${find_links:-none});" \
        "set PIP_FIND_LINKS to a folder that holds one" >&2
    exit 3
fi
# pip in the build reads this file: the host CA bundle (mounted above) and the wheel folders. Mounted, not
# copied, so nothing of this host stays in a layer.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\nfind-links = %s\n' "${wheel_dirs[*]}" > "$work/pip.conf"
mounts+=(-v "$work/pip.conf:/etc/pip.conf:ro")

echo "== building $tag (DEVICE=cpu, torch ${torch_version}+cpu, base $base)"
# TORCH_INDEX_URL=PyPI: torch's dependencies come from there; the +cpu wheel of the find-links folder outranks
# PyPI's build of the same version (a local version label sorts after the bare version).
buildah bud --isolation "${BUILDAH_ISOLATION:-chroot}" --format docker --layers \
    ${no_cache[@]+"${no_cache[@]}"} \
    "${mounts[@]}" \
    --build-arg DEVICE=cpu \
    --build-arg "BUILDER_IMAGE=$base" \
    --build-arg "RUNTIME_IMAGE=$base" \
    --build-arg "TORCH_VERSION=$torch_version" \
    --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
    --build-arg "RUN_TESTS=${run_tests:-0}" \
    -t "$tag" -f Dockerfile .

seconds=$(($(date +%s) - start))
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "built $tag in $seconds s: $((size / 1000000)) MB"
