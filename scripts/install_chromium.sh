#!/usr/bin/env bash
# Installs Debian's chromium for the report's browser test (tests/report/test_report.py) when it is missing.
# Idempotent: does nothing when chromium is already on PATH. Needs root (or sudo) and apt.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then
  echo "[chromium] present: $(command -v chromium || echo /usr/bin/chromium)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[chromium] missing and no apt-get here: install chromium with your package manager" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium
echo "[chromium] installed: $(command -v chromium)"
