#!/usr/bin/env bash
# Install traceml for development on a fresh machine: torch pinned to the
# CPU build that is available locally, then traceml (editable) and the test
# tools.  Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps -e .
