#!/usr/bin/env bash
# Debian packages that some tests need, installed through apt when missing (as root or with passwordless sudo):
#   chromium  headless browser for the status-page test (tests/integration/test_status_page.py)
#   faketime  libfaketime, which skews one peer's clock in the clock-skew test (tests/integration/test_clock_skew.py)
#   iptables, iproute2  the NAT lab's masquerading routers and namespaces (tests/integration/test_nat.py,
#             test_relay_limits.py)
# In CI (CI=true) a failed install is an error, so no such test can be skipped there unnoticed; elsewhere the
# tests whose package is missing skip with a reason.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing+=(iproute2)
[ ${#missing[@]} -eq 0 ] && exit 0
fail() {
  echo "install-system-packages: $1" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "install-system-packages: the tests that need ${missing[*]} will be skipped" >&2
  exit 0
}
command -v apt-get >/dev/null 2>&1 || fail "apt-get not found; install ${missing[*]} by hand"
SUDO=""
if [ "$(id -u)" != 0 ]; then
  sudo -n true 2>/dev/null || fail "not root and no passwordless sudo; run: sudo apt-get install -y ${missing[*]}"
  SUDO="sudo -n"
fi
log=$(mktemp /tmp/peerd-apt.XXXXXX.log)
if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
     >"$log" 2>&1; then
  tail -20 "$log" >&2
  fail "apt-get install ${missing[*]} failed (log: $log)"
fi
