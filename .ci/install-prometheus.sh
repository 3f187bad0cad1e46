#!/usr/bin/env bash
# Installs Debian's Prometheus server for tests/test_metrics.py (trap #14: `ray metrics launch-prometheus`
# downloads a release from GitHub and fails offline). No-op when a prometheus binary is already on PATH.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# the package's postinst starts a system service where systemd runs; tests start their own server instead
$SUDO apt-get install -y -qq --no-install-recommends prometheus
prometheus --version | head -1
