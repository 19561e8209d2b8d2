"""The ending rules on hand-built 1-, 2- and 8-rank runs: who stalled, who waits for
whom, which crash came first, and what is not a crash (traceml.diagnosis.ending)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.rows import step_row
from traceml.diagnosis.ending import diagnose_ending
from traceml.records import Incident, NodeInfo, RunData, RunMeta, SystemSample
from traceml.report import build_report, render_text, report_to_json, validate_summary
from traceml.stacks import Frame

T0 = 1000.0
USER = Frame("/home/me/train.py", 42, "forward")
WAIT = Frame("/usr/lib/python3.11/threading.py", 327, "wait")
BACKWARD = (Frame("/home/me/train.py", 90, "main"),
            Frame("/venv/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward"),
            Frame("/venv/lib/python3.11/site-packages/torch/autograd/graph.py", 979,
                  "_engine_run_backward"))
C10D = (Frame("/home/me/train.py", 90, "main"),
        Frame("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2501,
              "all_reduce"))


def run(world: int, incidents: list[Incident], exit_code: int | None = 130,
        ram_pct: float = 20.0) -> RunData:
    meta = RunMeta(session_id="s", command=["train.py"], started_at=T0, ended_at=T0 + 100,
                   exit_code=exit_code, partial=exit_code != 0, world_size=world,
                   missing_ranks=(), nodes=(NodeInfo(0, "h", tuple(range(world))),),
                   device="cpu", versions={}, transport={})
    steps = tuple(step_row(r, s, 1.0, 2.0, 3.0, 4.0, 10.0, 0.0, t=T0 + s)
                  for r in range(world) for s in range(30))
    system = tuple(SystemSample(0, "h", T0 + t, 50.0, ram_pct, 1 << 34) for t in range(0, 100, 5))
    return RunData(meta, steps, (), system, incidents=tuple(incidents))


def stall(rank: int, began: float, phase: str | None, open_phases: tuple[str, ...] = (),
          stack: tuple[Frame, ...] = (USER, WAIT), cleared: float | None = None) -> Incident:
    return Incident("stall", rank, 0, "h", 100 + rank, T0 + began, T0 + began + 3, cleared,
                    30, phase, open_phases or ((phase,) if phase else ()), stack, "python")


def waiter(rank: int, began: float, **kw: Any) -> Incident:
    return stall(rank, began, "communication", ("backward", "communication"), BACKWARD, **kw)


def crash(rank: int, at: float, what: str = "exception", **detail: Any) -> Incident:
    return Incident(what, rank, 0, "h", 100 + rank, T0 + at, T0 + at, None, 25, "forward",
                    (), (USER,) if what == "exception" else (), "python", detail)


def test_one_rank_stalled_alone_is_the_culprit() -> None:
    ending = diagnose_ending(run(1, [stall(0, 50.0, "forward")]))
    assert ending.state == "stalled" and ending.culprits == (0,)
    headline = ending.headline
    assert headline is not None and headline.label == "STALLED"
    assert headline.why.startswith("r0 (n0) made no progress for 50 s at step 30 in forward "
                                   "(train.py:42 in forward (threading.py:327 in wait))")


def test_two_ranks_the_one_outside_a_collective_is_named_and_the_other_waits() -> None:
    ending = diagnose_ending(run(2, [stall(1, 50.0, "forward"), waiter(0, 50.1)]))
    assert ending.state == "stalled" and ending.culprits == (1,)
    assert ending.headline is not None
    assert ("r0 (n0) waited for it in communication (backward's gradient all-reduce) "
            "(train.py:90 in main (graph.py:979 in _engine_run_backward))") in ending.headline.why


def test_eight_ranks_one_culprit_seven_waiting() -> None:
    incidents = [waiter(r, 50.2) for r in range(8) if r != 5] + [stall(5, 50.0, None)]
    ending = diagnose_ending(run(8, incidents))
    assert ending.culprits == (5,)
    assert ending.headline is not None
    assert "r5 (n0) made no progress for 50 s at step 30 outside every phase" in ending.headline.why
    # the seven waiting at the same frames are one clause
    assert ending.headline.why.count("waited for it") == 1
    assert ("r0, r1, r2, r3, r4, r6, r7 (n0) waited for it in communication (backward's "
            "gradient all-reduce)") in ending.headline.why


def test_a_job_wide_stall_at_8192_ranks_is_one_sentence_not_8191_clauses() -> None:
    world = 8192
    incidents = [dataclasses.replace(waiter(r, 50.2), node_rank=r // 8) for r in range(1, world)]
    incidents.append(stall(0, 50.0, "input"))
    ending = diagnose_ending(run(world, incidents))
    assert ending.culprits == (0,)
    headline = ending.headline
    assert headline is not None and len(headline.why) < 600, headline.why
    assert headline.why.startswith("r0 (n0) made no progress for 50 s at step 30 in input")
    assert ("r1, r2, r3, r4, r5, r6, r7, r8 +8183 more (on 1024 nodes) waited for it in "
            "communication") in headline.why
    # The card, at 1024 ranks (the report's cost is the step rows): a line per stack.
    small = [i for i in incidents if i.rank < 1024]
    report = build_report(run(1024, small), 10_000)
    card = [line.strip("| ") for line in render_text(report, width=400).splitlines()]
    stack_lines = [line for line in card if "stall stack" in line]
    assert stack_lines == [
        "- r0 stall stack (python): train.py:42 in forward > threading.py:327 in wait",
        "- r1, r2, r3, r4, r5, r6, r7, r8 +1015 more stall stack (python): "
        "train.py:90 in main > _tensor.py:623 in backward > graph.py:979 in _engine_run_backward"]
    # the JSON keeps every rank's incident
    assert len(report_to_json(report)["ending"]["incidents"]) == 1024


def test_the_card_shows_at_most_eight_stack_lines_then_counts() -> None:
    # 20 ranks each stopped at its own line: the culprit's line, 7 more, then a count.
    incidents = [stall(r, 50.2, "communication", ("communication",),
                       (Frame("/home/me/train.py", 100 + r, "main"), *C10D[1:]))
                 for r in range(1, 20)]
    report = build_report(run(20, [stall(0, 50.0, "input"), *incidents]), 10_000)
    card = [line.strip("| ") for line in render_text(report, width=400).splitlines()]
    stack_lines = [line for line in card if " stack (" in line or "other frames" in line]
    assert len(stack_lines) == 9 and stack_lines[0].startswith("- r0 stall stack")
    assert stack_lines[-1] == ("- 12 more ranks stopped at other frames "
                               "(final_summary.json has every stack)")


def test_many_different_crashes_after_the_first_are_counted_past_three() -> None:
    incidents = [crash(0, 60.0, type="ValueError", message="bad batch")]
    incidents += [crash(r, 60.0 + r, type="RuntimeError", message=f"peer {r} closed")
                  for r in range(1, 8)]
    ending = diagnose_ending(run(8, incidents, exit_code=1))
    assert ending.headline is not None
    why = ending.headline.why
    assert why.count("failed at step") == 3
    assert "r1 (n0) failed at step 25 in forward (RuntimeError: peer 1 closed)" in why
    assert why.endswith("; 4 more ranks failed after it.")


def test_eight_ranks_all_inside_collectives_name_the_first_to_stop_and_say_why() -> None:
    incidents = [waiter(r, 50.0 + 0.1 * r) for r in range(8)]
    incidents[3] = waiter(3, 49.0)
    ending = diagnose_ending(run(8, incidents))
    assert ending.state == "stalled" and ending.culprits == (3,)
    assert ending.headline is not None
    assert ending.headline.why.startswith("Every stalled rank is inside a collective")
    assert "same collectives in the same order" in ending.headline.next


def test_ranks_that_reported_no_stall_are_said() -> None:
    ending = diagnose_ending(run(8, [stall(2, 50.0, "optimizer")]))
    assert ending.headline is not None
    assert "r0, r1, r3, r4 +3 more reported no stall" in ending.headline.why


def test_a_cleared_stall_is_a_warning_with_its_duration_not_the_headline() -> None:
    ending = diagnose_ending(run(2, [stall(1, 40.0, "forward", cleared=T0 + 80.0),
                                     waiter(0, 40.1, cleared=T0 + 80.0)], exit_code=0))
    assert ending.state == "completed" and ending.headline is None
    (finding,) = ending.findings
    assert (finding.label, finding.severity, finding.ranks) == ("STALL CLEARED", "warn", (1,))
    assert finding.evidence["stalled_s"] == pytest.approx(40.0)
    assert "r1 (n0) made no progress for 40 s at step 30 in forward" in finding.why


def test_no_progress_until_a_clean_exit_is_not_a_stall() -> None:
    ending = diagnose_ending(run(1, [stall(0, 90.0, None)], exit_code=0))
    assert ending.state == "completed" and ending.headline is None
    assert [f.kind for f in ending.findings] == ["NO_PROGRESS_BEFORE_EXIT"]


def test_the_first_crash_is_the_culprit_and_those_after_it_follow() -> None:
    ending = diagnose_ending(run(2, [
        crash(0, 60.5, type="RuntimeError", message="Connection closed by peer"),
        crash(1, 60.0, type="ValueError", message="bad batch"),
        crash(1, 61.0, "exit", exit_code=1, signal=None),
        crash(0, 61.0, "exit", exit_code=-15, signal="SIGTERM")], exit_code=1))
    assert ending.state == "crashed" and ending.culprits == (1,)
    assert ending.headline is not None
    why = ending.headline.why
    assert why.startswith("r1 (n0) raised ValueError: bad batch at step 25 in forward "
                          "(train.py:42 in forward); exit 1")
    assert "then r0 (n0) failed at step 25 in forward (RuntimeError: Connection closed" in why


def test_ctrl_c_and_the_launchers_sigterm_are_not_crashes() -> None:
    ending = diagnose_ending(run(2, [
        crash(0, 60.0, type="KeyboardInterrupt", message=""),
        crash(1, 60.0, "exit", exit_code=-15, signal="SIGTERM")], exit_code=130))
    assert ending.state == "interrupted" and ending.headline is None


def test_a_stall_before_a_crash_is_the_cause() -> None:
    # r1 stops; much later the collective times out on r0 and raises there.
    ending = diagnose_ending(run(2, [stall(1, 10.0, "forward"), waiter(0, 10.1),
                                     crash(0, 90.0, type="RuntimeError", message="Timeout")],
                                 exit_code=1))
    assert ending.state == "stalled" and ending.culprits == (1,)
    assert ending.headline is not None and "then r0 (n0) failed" in ending.headline.why


@pytest.mark.parametrize(("ram_pct", "said"), [
    (97.0, "host memory was 97% full just before: likely the kernel's out-of-memory killer"),
    (30.0, "host memory was 30% full, so not the out-of-memory killer"),
])
def test_sigkill_names_its_likely_sender(ram_pct: float, said: str) -> None:
    ending = diagnose_ending(run(2, [crash(1, 60.0, "exit", exit_code=-9, signal="SIGKILL")],
                                 exit_code=137, ram_pct=ram_pct))
    assert ending.state == "crashed" and ending.headline is not None
    assert "r1 (n0) was killed by SIGKILL at step 25 in forward (no stack" in ending.headline.why
    assert said in ending.headline.why


def test_cuda_out_of_memory_gives_the_numbers() -> None:
    gib = 1 << 30
    ending = diagnose_ending(run(1, [crash(
        0, 60.0, type="torch.OutOfMemoryError", message="CUDA out of memory.",
        allocated_bytes=78 * gib, reserved_bytes=79 * gib, capacity_bytes=80 * gib,
        requested_bytes=2 * gib)], exit_code=1))
    assert ending.headline is not None
    assert ("r0 (n0) ran out of CUDA memory at step 25 in forward (train.py:42 in forward): "
            "78.0 GiB allocated, 79.0 GiB reserved of 80.0 GiB; it asked for 2.0 GiB more"
            in ending.headline.why)


def test_a_nonzero_exit_without_an_exception_is_failed() -> None:
    ending = diagnose_ending(run(2, [crash(1, 60.0, "exit", exit_code=3, signal=None)],
                                 exit_code=3))
    assert ending.state == "failed" and ending.headline is not None
    assert ending.headline.label == "FAILED"
    assert "r1 (n0) exited with status 3" in ending.headline.why


def test_the_ending_headlines_the_report_and_its_json_is_valid() -> None:
    report = build_report(run(2, [stall(1, 50.0, "forward"), waiter(0, 50.1)]), 10_000)
    assert report.primary.section == "ending" and report.primary.finding.label == "STALLED"
    doc = report_to_json(report)
    assert validate_summary(doc) == []
    incidents: Any = doc["ending"]
    assert [i["waiting_in_collective"] for i in incidents["incidents"]] == [False, True]
    assert incidents["incidents"][0]["stack"][0] == {
        "file": USER.file, "line": 42, "function": "forward", "user": True}


def test_ranks_left_waiting_for_a_rank_that_crashed_are_its_consequence() -> None:
    # r1 raises; r0 waits in its all-reduce past the threshold while r1's process exits.
    ending = diagnose_ending(run(2, [waiter(0, 59.9), crash(1, 60.0, type="ValueError",
                                                             message="bad batch")], exit_code=1))
    assert ending.state == "crashed" and ending.culprits == (1,)
    assert ending.headline is not None
    assert ("r0 (n0) was left waiting for it in communication (backward's gradient all-reduce)"
            in ending.headline.why)



def test_ranks_left_waiting_for_a_crash_are_grouped_largest_first_with_their_verb() -> None:
    phases_of = {1: "communication", 2: "communication", 3: "communication", 4: "forward",
                 5: "forward", 6: "backward", 7: "optimizer"}
    incidents = [stall(r, 59.9, p, stack=C10D) for r, p in phases_of.items()]
    incidents.append(crash(0, 60.0, type="ValueError", message="bad batch"))
    ending = diagnose_ending(run(8, incidents, exit_code=1))
    assert ending.state == "crashed" and ending.headline is not None
    assert ending.headline.why.endswith(
        "; r1, r2, r3 (n0) were left waiting for it in communication, r4, r5 (n0) were left "
        "waiting for it in forward, r6 (n0) was left waiting for it in backward, 1 more rank "
        "was left waiting for it elsewhere."), ending.headline.why


def test_up_to_three_ranks_each_get_their_own_clause_as_before() -> None:
    same = [stall(r, 50.0, "input") for r in range(3)]
    why = diagnose_ending(run(3, same)).headline.why  # type: ignore[union-attr]
    assert why.startswith("r0 (n0) made no progress for 50 s at step 30 in input (train.py:42 "
                          "in forward (threading.py:327 in wait)), r1 (n0) made no progress")
    four = diagnose_ending(run(4, [stall(r, 50.0, "input") for r in range(4)]))
    assert four.headline is not None
    assert four.headline.why.startswith("r0, r1, r2, r3 (n0) made no progress for 50 s")


def test_merged_ranks_name_up_to_four_nodes() -> None:
    incidents = [dataclasses.replace(waiter(r, 50.2), node_rank=r % 2) for r in range(1, 5)]
    ending = diagnose_ending(run(5, [stall(0, 50.0, "forward"), *incidents]))
    assert ending.headline is not None
    assert "r1, r2, r3, r4 (n0, n1) waited for it in communication" in ending.headline.why


def test_a_lone_rank_stalled_in_a_collective_leaves_no_empty_clause() -> None:
    ending = diagnose_ending(run(2, [waiter(0, 50.0)]))
    assert ending.headline is not None
    why = ending.headline.why
    assert "; ;" not in why and why.endswith("the first to stop; r1 reported no stall."), why


@pytest.mark.parametrize("world", [1, 2, 8])
def test_the_exit_status_decides_a_crash_not_a_message(world: int) -> None:
    """A crash report in a job its launcher saw exit 0 (a rank restarted by
    --max-restarts, or a forged incident) is never the verdict: the run completed, and
    the report is said at info.  The same report with exit 1 is the verdict."""
    reported = [crash(world - 1, 40.0, type="RuntimeError", message="boom")]
    completed = diagnose_ending(run(world, reported, exit_code=0))
    assert completed.state == "completed" and completed.headline is None
    [note] = [f for f in completed.findings if f.kind == "CRASH_NOT_CONFIRMED"]
    assert note.severity == "info" and note.ranks == (world - 1,)
    assert "exit status decides" in note.why
    report = build_report(run(world, reported, exit_code=0), 10000)
    assert report.primary.finding.label != "CRASHED"
    assert validate_summary(report_to_json(report)) == []
    failed = diagnose_ending(run(world, reported, exit_code=1))
    assert failed.state == "crashed" and failed.headline is not None
    assert failed.headline.label == "CRASHED"


def _lost(data: RunData, role: str = "launcher") -> RunData:
    meta = dataclasses.replace(data.meta, exit_code=None, lost=role,
                               telemetry_complete=False)
    return dataclasses.replace(data, meta=meta)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_lost_launcher_is_the_verdict_unless_a_stall_or_crash_explains_more(world: int) -> None:
    alone = diagnose_ending(_lost(run(world, [])))
    assert alone.state == "launcher_lost"
    assert alone.headline is not None and alone.headline.label == "LAUNCHER LOST"
    assert "As with torchrun" in alone.headline.why and "last step recorded: 29" in alone.headline.why
    # A hung job killed with kill -9: the stall stays the verdict, the loss beside it.
    hung = diagnose_ending(_lost(run(world, [stall(world - 1, 50.0, "forward")])))
    assert hung.state == "stalled" and hung.culprits == (world - 1,)
    assert [f.kind for f in hung.findings][-1] == "LAUNCHER_LOST"
    report = build_report(_lost(run(world, [])), 10000)
    assert report.primary.finding.label == "LAUNCHER LOST"
    assert validate_summary(report_to_json(report)) == []
    assert "exit unknown (launcher lost)" in render_text(report)


def test_under_traceml_init_the_lost_one_is_the_training_process() -> None:
    ending = diagnose_ending(_lost(run(1, []), role="process"))
    assert ending.headline is not None
    assert ending.headline.why.startswith("The training process ended at")
    assert "torchrun" not in ending.headline.why
    assert "exit unknown (process lost)" in render_text(build_report(_lost(run(1, []), "process"),
                                                                     10000))


def test_a_recorded_end_outweighs_a_lost_launcher() -> None:
    """The launcher's own end record (it came back, or its collector saw a stale parent)
    decides: no LAUNCHER LOST then."""
    from traceml.store.records import RunRecords
    from traceml.store.rows import run_data
    from traceml.wire.records import RunEnd, RunStart

    start = RunStart(session_id="s", command=("t",), started_at=T0, traceml_version="",
                     torch_version="", python_version="", summary_window_rows=0, mode="run")
    lost = run_data(RunRecords(start, None, (), {}, T0 + 5.0), (), (), ())
    assert lost.meta.lost == "launcher" and lost.meta.ended_at == T0 + 5.0
    assert not lost.meta.telemetry_complete and lost.meta.exit_code is None
    ended = run_data(RunRecords(start, RunEnd(T0 + 9.0, 0), (), {}, T0 + 5.0), (), (), ())
    assert ended.meta.lost is None and ended.meta.ended_at == T0 + 9.0
