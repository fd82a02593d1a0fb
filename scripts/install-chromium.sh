#!/usr/bin/env bash
# Debian's headless chromium for the status-page browser test (tests/integration/test_status_page.py).
# Installed through apt when missing, as root or with passwordless sudo. In CI (CI=true) a failed install is
# an error, so the browser test can never be skipped there unnoticed; elsewhere the test skips with a reason.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
fail() {
  echo "install-chromium: $1" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "install-chromium: the status-page browser test will be skipped" >&2
  exit 0
}
command -v apt-get >/dev/null 2>&1 || fail "apt-get not found; install chromium by hand"
SUDO=""
if [ "$(id -u)" != 0 ]; then
  sudo -n true 2>/dev/null || fail "not root and no passwordless sudo; run: sudo apt-get install -y chromium"
  SUDO="sudo -n"
fi
log=$(mktemp /tmp/peerd-apt-chromium.XXXXXX.log)
if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
     >"$log" 2>&1; then
  tail -20 "$log" >&2
  fail "apt-get install chromium failed (log: $log)"
fi
