#!/usr/bin/env bash
# Install a Chromium for the browser tests (tests/test_status_page.py drives it with Playwright for Python).
# Idempotent: does nothing when one is already there. Uses the OS package (Debian's `chromium`), never
# `playwright install` (which downloads a browser build of its own).
#
#   scripts/install-chromium.sh          # as root: apt-get install chromium when /usr/bin/chromium is missing
#   FLEETROUTE_CHROMIUM=/path/to/chrome  # or point the tests at any Chromium or Chrome instead
set -euo pipefail

if [ -n "${FLEETROUTE_CHROMIUM:-}" ]; then
    if [ -x "$FLEETROUTE_CHROMIUM" ]; then
        echo "install-chromium: using FLEETROUTE_CHROMIUM=$FLEETROUTE_CHROMIUM; nothing to do"
        exit 0
    fi
    echo "install-chromium: FLEETROUTE_CHROMIUM=$FLEETROUTE_CHROMIUM is not executable" >&2
    exit 1
fi
for candidate in /usr/bin/chromium chromium chromium-browser google-chrome; do
    if command -v "$candidate" >/dev/null 2>&1; then
        echo "install-chromium: $(command -v "$candidate") is there; nothing to do"
        exit 0
    fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: no Chromium found; install your OS's chromium package as root" \
         "(Debian/Ubuntu: apt-get install chromium), or set FLEETROUTE_CHROMIUM to a Chromium or Chrome" >&2
    exit 1
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The lock wait: another apt run on the machine (an image's unattended upgrade) finishes first.
apt-get -o DPkg::Lock::Timeout=300 install -y -qq chromium >/dev/null
echo "install-chromium: $(/usr/bin/chromium --version 2>/dev/null) in $(( $(date +%s) - start )) s"
