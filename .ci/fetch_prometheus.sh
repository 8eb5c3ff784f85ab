#!/usr/bin/env bash
# Unpack Debian's prometheus package (prometheus + promtool) into .prometheus/ for the
# end-to-end monitoring test (tests/monitor/test_prometheus_e2e.py). Never installs it:
# `apt-get install prometheus` would start a system service listening on all interfaces.
# Prints why and exits 0 when the package cannot be had; the test is then skipped.
set -u
cd "$(dirname "$0")/.."
dest=.prometheus
if [ -x "$dest/usr/bin/prometheus" ] && [ -x "$dest/usr/bin/promtool" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "fetch_prometheus: no apt-get/dpkg-deb here; the Prometheus end-to-end test will be skipped"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fetch() { (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1); }
if ! fetch; then
    apt-get update -qq >/dev/null 2>&1 || true
    if ! fetch; then
        echo "fetch_prometheus: 'apt-get download prometheus' failed; the Prometheus end-to-end test will be skipped"
        exit 0
    fi
fi
mkdir -p "$dest"
dpkg-deb -x "$tmp"/prometheus_*.deb "$dest"
echo "fetch_prometheus: $("$dest/usr/bin/prometheus" --version 2>&1 | head -1) in $dest/"
