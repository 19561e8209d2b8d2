#!/usr/bin/env bash
# Set everything up, then show what traceml is for on a 2-rank DDP job (CPU, gloo):
#   1. rank 1 loads each batch 20 ms slower  -> the card names r1 an INPUT STRAGGLER
#   2. the same job without the slowdown     -> the card says COMPUTE-BOUND
#   3. traceml compare of the two runs       -> IMPROVEMENT, most of it input time
# examples/train.py never imports traceml.  About 20 s after set-up on 2 cores.
# traceml and torch go into .venv (scripts/setup.sh); SKIP_SETUP=1 skips the set-up
# and runs with $PYTHON (default .venv/bin/python).  DEMO_LOGS_DIR (default logs)
# holds the sessions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${TRACEML_VENV:-.venv}/bin/python"
if [ "${SKIP_SETUP:-0}" != "1" ]; then
    scripts/setup.sh
else
    PY="${PYTHON:-$PY}"
fi
LOGS="${DEMO_LOGS_DIR:-logs}"
rm -rf "$LOGS/demo-slow" "$LOGS/demo-fixed"  # a session folder holds one run

train() {  # SESSION [train.py options]
    "$PY" -m traceml run --nproc-per-node=2 --logs-dir "$LOGS" --session-id "$1" \
        examples/train.py --steps 60 --device-ms 40 "${@:2}"
}

echo "== 1/3: rank 1 loads each batch 20 ms slower"
train demo-slow --slow-rank 1 --slow-input-ms 20
echo
echo "== 2/3: the same job, both ranks loading alike"
train demo-fixed
echo
echo "== 3/3: traceml compare $LOGS/demo-slow $LOGS/demo-fixed"
"$PY" -m traceml compare "$LOGS/demo-slow" "$LOGS/demo-fixed" --output "$LOGS/demo-compare"
