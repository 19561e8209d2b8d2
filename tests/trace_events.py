"""A checker of Chrome trace-event JSON as ui.perfetto.dev's and chrome://tracing's
importers read it (the "Trace Event Format" document): the fields each phase type needs,
and slices on one thread that nest, which both viewers need to draw them as a stack."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

NEEDS = {"X": ("name", "ts", "dur", "pid", "tid"), "i": ("name", "ts", "pid", "s"),
         "C": ("name", "ts", "pid", "args"), "M": ("name", "pid", "args")}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def load(path: Path) -> dict[str, Any]:
    """A trace file, gzip or not, as JSON."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    document = json.loads(data)
    assert isinstance(document, dict) and isinstance(document["traceEvents"], list)
    return document


def check(events: Iterable[dict[str, Any]]) -> None:
    """AssertionError, saying which event, unless every event is well formed and the
    complete slices of each thread nest."""
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for e in events:
        ph = e.get("ph")
        assert ph in NEEDS, f"phase type {ph!r} not written by traceml: {e}"
        missing = [k for k in NEEDS[ph] if k not in e]
        assert not missing, f"{missing} missing: {e}"
        assert isinstance(e["pid"], int) and e["pid"] > 0, e
        assert isinstance(e["name"], str) and e["name"], e
        if ph == "M":
            assert e["name"] in METADATA, e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] > 0, e
        if ph == "X":
            assert isinstance(e["tid"], int) and isinstance(e["dur"], (int, float)), e
            assert e["dur"] >= 0, e
            slices.setdefault((e["pid"], e["tid"]), []).append(
                (e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph == "i":
            assert e["s"] in ("t", "p", "g"), e
        else:  # a counter: numbers only
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
    for track, spans in slices.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for begin, end, name in spans:
            while stack and stack[-1][1] <= begin + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1][1] + 1e-3, (
                f"{name} [{begin}, {end}] overlaps {stack[-1]} on {track} without nesting")
            stack.append((begin, end, name))


def self_times(events: Iterable[dict[str, Any]], pid: int, tid: int
               ) -> list[tuple[dict[str, Any], float]]:
    """Each complete slice of a thread with its self time (µs): its duration less that of
    the slices directly nested in it."""
    spans = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == pid
                    and e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
    own = {id(e): float(e["dur"]) for e in spans}
    stack: list[dict[str, Any]] = []
    for e in spans:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + 1e-3:
            stack.pop()
        if stack:
            own[id(stack[-1])] -= e["dur"]
        stack.append(e)
    return [(e, own[id(e)]) for e in spans]
