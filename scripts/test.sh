#!/usr/bin/env bash
# Set everything up (scripts/setup.sh --dev: .venv with the test tools) and run the
# whole test suite in it: `scripts/test.sh [pytest args]`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
# The suite starts `traceml` and `python` by name too: the environment's own come first.
source "${TRACEML_VENV:-.venv}/bin/activate"
exec python -m pytest -q "$@"
