#!/usr/bin/env bash
# Install traceml for development on a fresh machine: torch pinned to the
# CPU build that is available locally, then traceml (editable) and the test
# tools.  Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# Live-view tests: Debian's Chromium driven by Playwright (Playwright's own
# browser download is not reachable) and tmux for the terminal view.
if { [ ! -x /usr/bin/chromium ] || ! command -v tmux >/dev/null; } && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium tmux >/dev/null
fi
"$PY" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
# The framework extras the tests in tests/frameworks/ run (torch stays pinned).
if [ "${SKIP_FRAMEWORK_EXTRAS:-0}" != "1" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
        -r requirements-frameworks.txt
fi
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps -e .
