#!/usr/bin/env bash
# Prepares this machine to build and run the sde2-reward-server image with podman.
#
# Idempotent: every step checks whether it is already done.
#   1. installs podman, runc, catatonit and debootstrap with apt (Debian/Ubuntu, as root) when missing;
#   2. writes the containers.conf podman needs here (no systemd, no rlimit changes allowed):
#        [containers] default_ulimits = []   and   [engine] cgroup_manager = "cgroupfs";
#   3. when the local base image is missing (this project's machines cannot pull base images; none
#      is tried), builds a Debian bookworm root with debootstrap (python3, python3-venv,
#      python3-pip) and imports it as a local stand-in for python:3.11-slim-bookworm. With a
#      registry at hand, build with `docker build` (or `podman build`) on the real base instead.
#
# Environment (all optional):
#   SDE2_PODMAN_DIR    where containers.conf is written     (default: docker/.podman in the repo)
#   SDE2_BASE_IMAGE    name of the imported base image      (default: localhost/sde2-base:bookworm)
#   SDE2_DEBIAN_MIRROR mirror for debootstrap               (default: http://deb.debian.org/debian)
#   SDE2_REBUILD_BASE  set to 1 to rebuild the base image even if present
#
# After it, use docker/build.sh.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
podman_dir="${SDE2_PODMAN_DIR:-$here/.podman}"
base_image="${SDE2_BASE_IMAGE:-localhost/sde2-base:bookworm}"
mirror="${SDE2_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
conf="$podman_dir/containers.conf"

log() { printf '[podman-setup] %s\n' "$*" >&2; }

# --- 1. packages -------------------------------------------------------------------------------
missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
[ -x /usr/sbin/runc ] || command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
# `podman kube play` (tests/test_k8s.py) starts each pod with catatonit as its infra process.
command -v catatonit >/dev/null 2>&1 || [ -x /usr/libexec/podman/catatonit ] || missing+=(catatonit)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "missing: ${missing[*]}; install them (needs root and apt-get) and rerun"
        exit 1
    fi
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}" uidmap fuse-overlayfs slirp4netns ca-certificates
else
    log "podman, runc, catatonit and debootstrap present"
fi

# --- 2. containers.conf ------------------------------------------------------------------------
mkdir -p "$podman_dir"
want_conf='# Written by docker/podman-setup.sh: podman on a machine without systemd and with fixed rlimits.
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
'
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$(printf '%s' "$want_conf")" ]; then
    printf '%s' "$want_conf" >"$conf"
    log "wrote $conf"
else
    log "$conf up to date"
fi
export CONTAINERS_CONF="$conf"

runc_bin="$(command -v runc || echo /usr/sbin/runc)"
podman_cmd=(podman --runtime "$runc_bin")

# --- 3. base image -----------------------------------------------------------------------------
if [ "${SDE2_REBUILD_BASE:-0}" != "1" ] && "${podman_cmd[@]}" image exists "$base_image"; then
    log "base image $base_image present"
else
    rootfs="$(mktemp -d /var/tmp/sde2-bookworm.XXXXXX)"
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap bookworm into $rootfs (a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
        tail -n 30 "$rootfs.log" >&2
        log "debootstrap failed (full log: $rootfs.log)"
        exit 1
    }
    # Keep the stand-in small and close to the slim image: no apt lists or package caches.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    log "importing as $base_image"
    tar -C "$rootfs" -c . | "${podman_cmd[@]}" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        - "$base_image" >/dev/null
    rm -f "$rootfs.log"
    log "base image $base_image ready"
fi

"${podman_cmd[@]}" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$base_image" >&2
log "done. Build with: bash docker/build.sh"
