"""Profiler captures off the training path: the wire's ask and report, the operators'
difference on hand-built 1-, 2- and 8-rank captures, the live trigger's choices, and the
window that leaves captured steps out."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.rows import step_row
from traceml.diagnosis.finding import Finding
from traceml.diagnosis.operators import capture_results
from traceml.diagnosis.window import capture_spans, select_window
from traceml.errors import ProtocolError
from traceml.live import captures as trigger_module
from traceml.live.captures import CaptureTrigger
from traceml.records import Capture, NodeInfo, RunData, RunMeta
from traceml.records_json import from_jsonable
from traceml.report import build_report, report_to_json, validate_summary
from traceml.report.text import capture_lines, render_text
from traceml.wire.captures import CaptureAsk, CaptureReport, OperatorRow, is_communication

SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"


# -- the wire ----------------------------------------------------------------------------

def test_an_ask_round_trips_and_a_bad_one_is_refused() -> None:
    ask = CaptureAsk("c1-compute_straggler", (1, 0), 197, 2, 50_000_000)
    assert CaptureAsk.from_payload(json.loads(json.dumps(ask.payload()))) == ask
    for bad in ({"ranks": []}, {"ranks": [-1]}, {"steps": 0}, {"steps": 21},
                {"id": "x" * 65}, {"id": "a\nb"}, {"start_after": -1}, {"max_bytes": 0},
                {"op": "stop"}):
        with pytest.raises(ProtocolError):
            CaptureAsk.from_payload({**ask.payload(), **bad})


def test_a_report_is_checked_and_its_text_escaped() -> None:
    report = CaptureReport("c1", 2, 2, 1.0e9, 1.0e9 + 1, "/x/c1-r1.pt.trace.json.gz", 100,
                           None, None, (OperatorRow("aten::mm\x1b[31m", "[4, 4]", 3.0, 1.5),))
    back = CaptureReport.from_payload(json.loads(json.dumps(report.payload())))
    assert back.operators[0].name == "aten::mm\\x1b[31m"  # a terminal escape stays text
    assert back.operators[0].self_ms == 1.5 and back.num_steps == 2
    for bad in ({"num_steps": 3}, {"steps_asked": 0}, {"began_at": -5.0},
                {"operators": [["aten::mm", "", -1.0, 1.0, None, "compute"]]},
                {"operators": [["aten::mm", "", 1.0, 1.0, None, "elsewhere"]]},
                {"operators": [["aten::mm", "", 1.0]]}, {"trace_bytes": -1}):
        with pytest.raises(ProtocolError):
            CaptureReport.from_payload({**report.payload(), **bad})


def test_collectives_are_told_apart_by_name() -> None:
    assert all(map(is_communication, ("gloo:all_reduce", "c10d::allreduce_", "nccl:all_reduce",
                                      "record_param_comms", "c10d::broadcast_")))
    assert not any(map(is_communication, ("aten::mm", "aten::addmm", "Optimizer.step#SGD.step")))


# -- the operators' difference ----------------------------------------------------------

def capture(rank: int, role: str, ops: list[tuple[str, str, float, float]], *,
            trigger: str = "COMPUTE_STRAGGLER", num_steps: int = 2, reported: bool = True,
            **fields: Any) -> Capture:
    values: dict[str, Any] = {
        "reported_at": 1010.0 if reported else None, "num_steps": num_steps if reported else 0,
        "began_at": 1001.0, "ended_at": 1002.0, "host": "h",
        "path": f"/logs/s/captures/c1-r{rank}.pt.trace.json.gz", "trace_bytes": 1000,
        "operators": tuple((n, s, c, ms, None, "compute") for n, s, c, ms in ops)}
    return Capture("c1", rank, role, trigger, f"{trigger} r1", "compute", 1000.0, 40, 2,
                   **(values | fields))


SUSPECT = [("aten::mm", "[512, 512], [512, 512]", 5.0, 30.0), ("aten::mm", "[1, 512]", 2.0, 1.0),
           ("aten::addmm", "[512], [512, 512]", 3.0, 12.0), ("gloo:all_reduce", "", 2.0, 5.0),
           ("aten::relu", "[512, 512]", 3.0, 1.0)]
REFERENCE = [("aten::mm", "[256, 512], [512, 512]", 5.0, 15.0), ("aten::mm", "[1, 256]", 2.0, 1.0),
             ("aten::addmm", "[512], [256, 512]", 3.0, 6.0), ("gloo:all_reduce", "", 2.0, 25.0),
             ("aten::relu", "[256, 512]", 3.0, 0.5)]


def test_two_ranks_the_suspects_operators_against_the_reference() -> None:
    step_ms = (("compute", 50.0), ("total", 80.0))
    rows = [capture(1, "suspect", SUSPECT, step_ms=step_ms),
            capture(0, "reference", REFERENCE, step_ms=(("compute", 28.0), ("total", 80.0)))]
    (result,) = capture_results(rows)
    assert (result.suspect, result.reference, result.num_steps) == (1, 0, 2)
    top = result.operators[0]
    assert (top.name, top.diff_ms, top.suspect_calls) == ("aten::mm", 15.0, 7.0)
    assert (top.suspect_shapes, top.reference_shapes) == ("[512, 512], [512, 512]",
                                                          "[256, 512], [512, 512]")
    # the collective is set apart: r1 waited less, it did not work less
    assert result.compute_diff_ms == pytest.approx(15.0 + 6.0 + 0.5)
    assert result.communication_diff_ms == pytest.approx(-20.0)
    assert result.phase_diff_ms == pytest.approx(22.0)
    assert result.complete
    text = "\n".join(capture_lines(result))
    assert "aten::mm +15.00 ms (31.00 vs 16.00)" in text and "r0: [256, 512]" in text
    assert "the compute operators +21.5 ms" in text and "compute as traceml timed these steps: +22.0" in text


def test_a_communication_bound_capture_lists_by_time_with_the_collective_on_top() -> None:
    rows = [capture(1, "suspect", REFERENCE, trigger="COMMUNICATION_BOUND"),
            capture(0, "reference", REFERENCE, trigger="COMMUNICATION_BOUND")]
    (result,) = capture_results(rows)
    assert result.operators[0].name == "gloo:all_reduce" and result.operators[0].communication


def test_one_rank_lists_its_own_operators() -> None:
    (result,) = capture_results([capture(0, "suspect", SUSPECT, trigger="OUTLIER_STEPS")])
    assert result.reference is None and result.compute_diff_ms is None
    assert [o.name for o in result.operators[:2]] == ["aten::mm", "aten::addmm"]
    assert result.operators[0].diff_ms is None
    assert "r0, host self time per step" in "\n".join(capture_lines(result))


def test_a_missing_or_cut_report_is_said_and_nothing_is_compared() -> None:
    rows = [capture(1, "suspect", SUSPECT, cut="the trace reached its cap of 1 MiB after 1 of 2 "
                    "steps", num_steps=1),
            capture(0, "reference", REFERENCE, reported=False)]
    (result,) = capture_results(rows)
    assert result.operators == () and result.num_steps == 0 and not result.complete
    assert any("r0 sent no report" in n for n in result.notes)
    assert any("reached its cap" in n for n in result.notes)


def test_an_eight_rank_run_is_asked_of_the_suspect_and_the_median_rank() -> None:
    # r5 is slow; the others' typical steps are 10..16 ms: the median of the seven others
    steps = tuple(step_row(r, s, 1.0, 2.0, 3.0, 1.0, 40.0 if r == 5 else 10.0 + r, 0.0,
                           t=1000.0 + s) for r in range(8) for s in range(30))
    run = RunData(meta(8), steps, (), ())
    assert trigger_module._reference_rank(run, 5) == 3
    assert trigger_module._reference_rank(RunData(meta(1), steps[:30], (), ()), 0) is None


# -- the trigger ----------------------------------------------------------------------

def meta(world: int) -> RunMeta:
    return RunMeta(session_id="s", command=["train.py"], started_at=999.0, ended_at=1100.0,
                   exit_code=None, partial=False, world_size=world, missing_ranks=(),
                   nodes=(NodeInfo(0, "h", tuple(range(world))),), device="cpu", versions={},
                   transport={})


def straggler(rank: int, severity: str = "warn") -> Finding:
    return Finding("COMPUTE_STRAGGLER", "COMPUTE STRAGGLER", severity, "r1 is slow.", "",
                   (rank,), {"excess_ms": 10.0})


def test_a_finding_asks_once_it_held_and_once_per_kind(tmp_path: Path) -> None:
    trigger = CaptureTrigger(tmp_path / "none.sqlite", auto=True, steps=2, max_bytes=10**6)
    steps = tuple(step_row(r, s, 1.0, 2.0, 3.0, 1.0, 20.0 if r == 1 else 10.0, 0.0,
                           t=1000.0 + s) for r in range(2) for s in range(50))
    run = RunData(meta(2), steps, (), ())
    trigger._watch(run, [straggler(1, "info")])  # not actionable
    trigger._watch(run, [straggler(1)])
    trigger._watch(run, [straggler(0)])  # another rank: held again from one
    trigger._watch(run, [straggler(0)])
    assert trigger.take() == []
    trigger._watch(run, [straggler(0)])
    ((ask, rows),) = trigger.take()
    assert ask.ranks == (0, 1) and ask.steps == 2 and ask.max_bytes == 10**6
    # ahead of the ranks' last step by LEAD_S of 20 ms steps
    assert ask.start_after == 50 + int(trigger_module.LEAD_S / 0.020)
    assert [(r.rank, r.role, r.label) for r in rows] == [
        (0, "suspect", "COMPUTE STRAGGLER r0"), (1, "reference", "COMPUTE STRAGGLER r0")]
    trigger._open_until = 0.0
    for _ in range(5):
        trigger._watch(run, [straggler(1)])
    assert trigger.take() == []  # a second finding of the same kind does not capture again
    bound = Finding("COMMUNICATION_BOUND", "COMMUNICATION-BOUND", "warn", "waits.", "", (0,))
    for _ in range(5):
        trigger._watch(run, [bound])
    assert trigger.take() == []  # the straggler's shadow: its capture already shows it


def test_a_manual_request_is_checked(tmp_path: Path) -> None:
    trigger = CaptureTrigger(tmp_path / "none.sqlite", auto=False, steps=2, max_bytes=10**6)
    for bad in (b"{", b"[]", b'{"op": "capture", "rank": -1, "steps": 2}',
                b'{"op": "capture", "rank": 1, "steps": 0}', b'{"op": "stop", "rank": 1}'):
        with pytest.raises(ValueError):
            trigger.request(bad)
    trigger.request(b'{"op": "capture", "rank": 1, "steps": 3}')
    assert trigger._requests.get_nowait() == (1, 3)


# -- the window and the summary -----------------------------------------------------------

def test_captured_steps_are_left_out_of_the_window_on_every_rank() -> None:
    steps = tuple(step_row(r, s, 1.0, 2.0, 3.0, 1.0, 10.0, 0.0, t=1000.0 + 0.01 * (s + 1))
                  for r in range(2) for s in range(40))
    # r1 profiled the steps that ran from 1000.20 to 1000.23 (steps 20, 21 and 22)
    spans = capture_spans([capture(1, "suspect", SUSPECT, began_at=1000.2005,
                                   ended_at=1000.2295)])
    window = select_window(steps, 10_000, 2, spans)
    assert window.num_captured_steps == 3
    assert {20, 21, 22}.isdisjoint(window.steps) and 19 in window.steps and 23 in window.steps
    assert select_window(steps, 10_000, 2).num_captured_steps == 0


def test_a_summary_with_a_capture_is_valid_and_the_card_shows_it() -> None:
    run = from_jsonable(json.loads((SCENARIOS / "input_straggler_2r" / "run.json").read_text()))
    run = dataclasses.replace(run, captures=(capture(1, "suspect", SUSPECT),
                                             capture(0, "reference", REFERENCE)))
    report = build_report(run, 10_000)
    summary = report_to_json(report)
    assert validate_summary(summary) == []
    (c,) = summary["captures"]
    assert c["operators"][0]["name"] == "aten::mm" and c["operators"][0]["diff_ms"] == 15.0
    assert "Operators (profiler capture c1, for COMPUTE_STRAGGLER r1" in render_text(report)
