#!/usr/bin/env bash
# Set everything up and run a demo training job (2 DDP ranks on CPU) under traceml.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${PYTHON:-python3}" -m traceml run --nproc-per-node=2 examples/train.py --steps 60
