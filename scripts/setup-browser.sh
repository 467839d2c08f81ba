#!/usr/bin/env bash
# Installs Debian's chromium and chromedriver for the inspector's browser tests (tests marked
# `browser`): nothing is downloaded at test time. Runs apt only when either is missing, and only
# as root on a Debian-like system; otherwise it says what to install and leaves the tests to fail
# with the same message.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-browser: install Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver) for the browser tests" >&2
    exit 0
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver
