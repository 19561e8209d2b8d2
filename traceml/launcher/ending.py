"""What the launcher prints when the run is over (launcher side)."""

from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from traceml.collector.store import STORE_FILENAME, StoreReader

PHASES = ("input_ms", "forward_ms", "backward_ms", "optimizer_ms", "wait_ms", "total_ms")


def phase_table(path: Path) -> str:
    """Per-rank mean phase times, from the store."""
    reader = StoreReader(str(path))
    try:
        rows = reader.steps()
    finally:
        reader.close()
    by_rank: dict[int, list[list[float]]] = {}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), []).append([float(row[p] or 0.0) for p in PHASES])
    table = []
    for rank in sorted(by_rank):
        steps = by_rank[rank]
        means = [sum(col) / len(steps) for col in zip(*steps)]
        table.append([f"r{rank}", len(steps), *(f"{m:.2f}" for m in means)])
    headers = ["rank", "steps", "input ms", "forward ms", "backward ms", "optimizer ms",
               "wait ms", "total ms"]
    if not table:
        return "traceml: no training steps were captured."
    return "traceml: mean time per step\n" + tabulate(table, headers=headers, disable_numparse=True)


def print_ending(session_dir: Path, collector_alive: bool) -> None:
    store = session_dir / STORE_FILENAME
    if not collector_alive:
        print("traceml: warning: the collector stopped during the run; "
              "steps after that were not recorded", file=sys.stderr)
    if store.exists():
        print(phase_table(store), file=sys.stderr)
    print(f"traceml: session folder: {session_dir}", file=sys.stderr)
