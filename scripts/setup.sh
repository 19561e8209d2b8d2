#!/usr/bin/env bash
# Install traceml into the project's own virtual environment, .venv in the
# repository root (TRACEML_VENV to put it elsewhere), created with python3
# (BASE_PYTHON to choose another).  A Python the system manages (Debian's, which
# refuses pip with "externally-managed-environment") is only used to create it.
#
#   scripts/setup.sh          torch 2.13.0 (the CPU build on this disk) and the
#                             runtime dependencies: what scripts/demo.sh needs
#   scripts/setup.sh --dev    also the test tools, the framework extras the tests
#                             in tests/frameworks/ run (SKIP_FRAMEWORK_EXTRAS=1
#                             leaves them out), Chromium and tmux
#
# Safe to run again.  Use it afterwards with `. .venv/bin/activate`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
case "${1:-}" in
    --dev) DEV=1 ;;
    "") ;;
    *) echo "usage: scripts/setup.sh [--dev]" >&2; exit 2 ;;
esac
VENV="${TRACEML_VENV:-.venv}"
BASE="${BASE_PYTHON:-python3}"

# An environment without a working pip (a venv made where ensurepip was missing) is
# made again; a folder that is not one is left alone.
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
        echo "scripts/setup.sh: $VENV exists and is not a virtual environment;" \
             "move it, or set TRACEML_VENV to another folder" >&2
        exit 1
    fi
    if ! "$BASE" -m venv --clear "$VENV" 2>/dev/null; then
        # Debian and Ubuntu ship venv's pip bootstrap separately.
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        "$BASE" -m venv --clear "$VENV" || {
            echo "scripts/setup.sh: $BASE cannot create a virtual environment" \
                 "(on Debian or Ubuntu: apt-get install python3-venv)" >&2
            exit 1
        }
    fi
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if [ "$DEV" = 1 ]; then
    # Live-view tests: Debian's Chromium driven by Playwright (Playwright's own
    # browser download is not reachable) and tmux for the terminal view; the
    # metrics test scrapes with a real Prometheus server (Debian's).
    if [ ! -x /usr/bin/chromium ] || ! command -v tmux >/dev/null \
            || [ ! -x /usr/bin/prometheus ]; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium tmux >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                prometheus >/dev/null
        else
            echo "scripts/setup.sh: the live-view and metrics tests need Debian's chromium," \
                 "tmux and prometheus: apt-get install chromium tmux prometheus (as root)" >&2
        fi
    fi
    "${PIP[@]}" -r requirements-dev.txt
    # The framework extras the tests in tests/frameworks/ run (torch stays pinned).
    if [ "${SKIP_FRAMEWORK_EXTRAS:-0}" != "1" ]; then
        "${PIP[@]}" "torch==2.13.0" -r requirements-frameworks.txt
    fi
else
    "${PIP[@]}" "torch==2.13.0"
fi
# The runtime dependencies come from pyproject.toml (torch stays pinned).
"${PIP[@]}" "torch==2.13.0" -e .
