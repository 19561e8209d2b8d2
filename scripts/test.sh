#!/usr/bin/env bash
# Set everything up and run the whole test suite: `scripts/test.sh [pytest args]`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
