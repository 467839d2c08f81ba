#!/usr/bin/env bash
# Builds the sde2-reward-server image with podman (runc, host network, docker image format).
#
#   bash docker/build.sh                 # CPU image  -> localhost/sde2-reward-server:latest
#   bash docker/build.sh --gpu           # docker/Dockerfile.gpu -> localhost/sde2-reward-server:gpu
#   bash docker/build.sh --if-changed    # skip when the image was built from the same sources
#   bash docker/build.sh --print-hash    # print the source hash the image would be labelled with
#   bash docker/build.sh -- --no-cache   # anything after -- goes to `podman build`
#
# Environment (all optional):
#   IMAGE              image name           (localhost/sde2-reward-server:latest, :gpu with --gpu)
#   BASE_IMAGE         base of the stages   (localhost/sde2-base:bookworm when present, made by
#                                            podman-setup.sh; else python:3.11-slim-bookworm;
#                                            with --gpu: nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04)
#   EXPORT_BASE_IMAGE  --gpu only: base of the export stage (same default as the CPU BASE_IMAGE)
#   TORCH_FIND_LINKS   folder with the torch CPU wheel (/opt/wheels when it holds a torch wheel;
#                      mounted read-only into the build)
#   TORCH_INDEX_URL    torch index when TORCH_FIND_LINKS is empty (https://download.pytorch.org/whl/cpu)
#   SERVER_EXTRAS      extras of the server venv (server; "server math" adds the math matcher)
#   SKIP_SETUP=1       do not run podman-setup.sh first
#
# Prints the image id, the build time and the image size; labels the image with
# org.sde2.source-hash (sources + Dockerfile + build arguments) for --if-changed, and
# org.sde2.image (its name). After a rebuild, the untagged images that earlier builds of the same
# name left (the replaced image, its exporter and builder stages) are removed: each rebuild would
# otherwise keep ~2.7 GB. This build's stages stay, as the layer cache of the next one.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$root"

gpu=0
if_changed=0
print_hash=0
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --gpu) gpu=1 ;;
        --if-changed) if_changed=1 ;;
        --print-hash) print_hash=1 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

log() { printf '[build] %s\n' "$*" >&2; }

if [ "${SKIP_SETUP:-0}" != "1" ]; then
    bash "$here/podman-setup.sh"
fi
export CONTAINERS_CONF="${CONTAINERS_CONF:-${SDE2_PODMAN_DIR:-$here/.podman}/containers.conf}"
runc_bin="$(command -v runc || echo /usr/sbin/runc)"
podman_cmd=(podman --runtime "$runc_bin")

local_base="${SDE2_BASE_IMAGE:-localhost/sde2-base:bookworm}"
if "${podman_cmd[@]}" image exists "$local_base"; then
    cpu_base="$local_base"
else
    cpu_base="python:3.11-slim-bookworm"
fi

if [ "$gpu" = 1 ]; then
    dockerfile="docker/Dockerfile.gpu"
    image="${IMAGE:-localhost/sde2-reward-server:gpu}"
    base="${BASE_IMAGE:-nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04}"
else
    dockerfile="docker/Dockerfile"
    image="${IMAGE:-localhost/sde2-reward-server:latest}"
    base="${BASE_IMAGE:-$cpu_base}"
fi

if [ -z "${TORCH_FIND_LINKS+x}" ]; then
    if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
        TORCH_FIND_LINKS=/opt/wheels
    else
        TORCH_FIND_LINKS=
    fi
fi
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

build_args=(
    --build-arg "BASE_IMAGE=$base"
    --build-arg "TORCH_FIND_LINKS=$TORCH_FIND_LINKS"
    --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"
    --build-arg "SERVER_EXTRAS=${SERVER_EXTRAS:-server}"
)
if [ "$gpu" = 1 ]; then
    build_args+=(--build-arg "EXPORT_BASE_IMAGE=${EXPORT_BASE_IMAGE:-$cpu_base}")
fi
volumes=()
# pip inside the build trusts the host's CA bundle (the Dockerfile points PIP_CERT at it when
# present), so it reaches the registry through whatever TLS setup the host has.
[ -d /etc/ssl/certs ] && volumes+=(-v /etc/ssl/certs:/etc/ssl/certs:ro)
if [ -n "$TORCH_FIND_LINKS" ] && [ -d "$TORCH_FIND_LINKS" ]; then
    volumes+=(-v "$TORCH_FIND_LINKS:$TORCH_FIND_LINKS:ro")
fi

# What the image is made of: the files the build context holds for the Dockerfile's COPYs, the
# Dockerfile and the build arguments. Untracked files count too (git ls-files -co).
source_hash="$(
    {
        git ls-files -co --exclude-standard -- pyproject.toml setup.py MANIFEST.in README.md LICENSE \
            reward_server trainer_client protos "$dockerfile" .dockerignore | LC_ALL=C sort | while read -r f; do
            [ -f "$f" ] && printf '%s %s\n' "$(sha256sum <"$f" | cut -c1-64)" "$f"
        done
        printf '%s\n' "${build_args[@]}"
        # What goes to podman build after --, and which base image (by id: a rebuilt base of
        # the same name is another build).
        printf 'extra %s\n' "${extra[@]+"${extra[@]}"}"
        "${podman_cmd[@]}" image inspect --format '{{.Id}}' "$base" 2>/dev/null || true
    } | sha256sum | cut -c1-16
)"

if [ "$print_hash" = 1 ]; then
    printf '%s\n' "$source_hash"
    exit 0
fi

if [ "$if_changed" = 1 ] && "${podman_cmd[@]}" image exists "$image"; then
    have="$("${podman_cmd[@]}" image inspect --format '{{index .Labels "org.sde2.source-hash"}}' "$image" 2>/dev/null || true)"
    if [ "$have" = "$source_hash" ]; then
        log "$image is up to date (source hash $source_hash); not rebuilding"
        "${podman_cmd[@]}" image inspect --format '{{.Id}} {{.Size}}' "$image"
        exit 0
    fi
    log "$image has source hash '${have}', sources are $source_hash: rebuilding"
fi

log "building $image from $dockerfile on $base (torch from ${TORCH_FIND_LINKS:-$TORCH_INDEX_URL})"
start=$(date +%s)
"${podman_cmd[@]}" build \
    --format docker \
    --network host \
    "${volumes[@]}" \
    "${build_args[@]}" \
    --label "org.sde2.source-hash=$source_hash" \
    --label "org.sde2.image=$image" \
    -f "$dockerfile" \
    -t "$image" \
    "${extra[@]}" \
    .
elapsed=$(( $(date +%s) - start ))

# Untagged images of this name from other sources: what earlier builds left. `rmi` also drops
# their parent layers that nothing else uses; layers this build shares with them stay.
stale="$("${podman_cmd[@]}" images --filter dangling=true --filter "label=org.sde2.image=$image" \
    --format '{{.ID}} {{index .Labels "org.sde2.source-hash"}}' | awk -v h="$source_hash" '$2 != h {print $1}')"
if [ -n "$stale" ]; then
    # shellcheck disable=SC2086 # one id per word
    if "${podman_cmd[@]}" rmi $stale >/dev/null 2>&1; then
        log "removed $(wc -w <<<"$stale") untagged image(s) of earlier builds of $image"
    else
        log "kept some untagged images of earlier builds of $image (in use?)"
    fi
fi
size="$("${podman_cmd[@]}" image inspect --format '{{.Size}}' "$image")"
log "built $image in ${elapsed}s; size $size bytes ($(( size / 1000000 )) MB)"
"${podman_cmd[@]}" image inspect --format '{{.Id}} {{.Size}}' "$image"
