"""build_report: the primary finding, and the analysis code's import boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.rows import step_row
from traceml.diagnosis.finding import Finding, Severity, not_measured
from traceml.diagnosis.process import RankProcess
from traceml.diagnosis.window import Scope, select_window
from traceml.records import NodeInfo, ProcessSample, RunData, RunMeta
from traceml.report.build import choose_primary, process_section
from traceml.report.model import SECTION_NAMES, Section

SCOPE = Scope(window_rows=10, ranks=(0,), missing_ranks=(), nodes=(0,), num_nodes=1)


def section(name: str, label: str, severity: Severity = "info", measured: bool = True
            ) -> Section:
    finding = (Finding(label.replace(" ", "_"), label, severity, "why", "next")
               if measured else not_measured(label, "why"))
    return Section(name, (finding,), SCOPE, {}, ())


def sections(**diagnoses: tuple[str, Severity]) -> dict[str, Section]:
    healthy: dict[str, tuple[str, Severity]] = {
        "step_time": ("BALANCED", "info"), "step_memory": ("BALANCED", "info"),
        "process": ("NORMAL", "info"), "system": ("NORMAL", "info"),
        "throughput": ("THROUGHPUT", "info"),
    }
    healthy.update(diagnoses)
    return {name: section(name, *healthy[name]) for name in SECTION_NAMES}


def test_healthy_run_shows_step_time() -> None:
    primary = choose_primary(sections(step_time=("COMPUTE-BOUND", "info")))
    assert (primary.section, primary.finding.label) == ("step_time", "COMPUTE-BOUND")


def test_most_severe_actionable_wins_across_sections() -> None:
    primary = choose_primary(sections(step_time=("INPUT-BOUND", "warn"),
                                      system=("RAM PRESSURE", "crit")))
    assert (primary.section, primary.finding.label) == ("system", "RAM PRESSURE")


@pytest.mark.parametrize(
    ("diagnoses", "winner"),
    [
        ({"step_time": ("WAIT-HEAVY", "warn"), "step_memory": ("MEMORY CREEP", "warn")},
         "step_time"),
        ({"step_memory": ("MEMORY CREEP", "warn"), "process": ("HIGH RSS", "warn")},
         "step_memory"),
        ({"process": ("HIGH CPU", "warn"), "system": ("LOW GPU UTIL", "warn")}, "system"),
    ],
)
def test_ties_follow_section_priority(diagnoses: dict[str, tuple[str, Severity]],
                                      winner: str) -> None:
    assert choose_primary(sections(**diagnoses)).section == winner


def test_unmeasured_step_time_falls_back_to_a_measured_section() -> None:
    parts = sections()
    parts["step_time"] = section("step_time", "STEP TIME", measured=False)
    parts["step_memory"] = section("step_memory", "STEP MEMORY", measured=False)
    primary = choose_primary(parts)
    assert (primary.section, primary.finding.label) == ("system", "NORMAL")


def test_analysis_code_imports_no_torch_zmq_or_rich() -> None:
    code = (
        "import sys, traceml.records, traceml.report, traceml.report.text; "
        "bad = {'torch', 'zmq', 'rich'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_advice_fits_a_cpu_only_run_and_a_saturated_host() -> None:
    from tests.unit.test_diagnosis_step_time import times_of, uniform
    from traceml.diagnosis.step_time import diagnose_step_time

    times = times_of(1, uniform((30.0, 20.0, 40.0, 10.0, 0.0)))  # 30 % input
    on_cpu = diagnose_step_time(times, device="cpu")[0]
    on_gpu = diagnose_step_time(times, device="cuda")[0]
    assert on_cpu.kind == on_gpu.kind == "INPUT_BOUND"
    assert "GPU" not in on_cpu.next and on_gpu.next.startswith("Feed the GPU faster")
    straggling = times_of(2, lambda r: (5.0, 20.0 + 30.0 * r, 40.0, 10.0, 0.0))
    compute = diagnose_step_time(straggling, device="cpu")[0]
    assert compute.kind == "COMPUTE_STRAGGLER" and "GPU" not in compute.next
    # On a host whose CPUs are saturated, more DataLoader workers is the wrong advice.
    from traceml.report.build import SATURATED_INPUT_NEXT, fit_advice

    step_time = Section("step_time", (on_cpu,), SCOPE, {}, ())
    busy = section("system", "CPU PRESSURE", "warn")
    assert fit_advice(step_time, busy).diagnosis.next == SATURATED_INPUT_NEXT
    assert fit_advice(step_time, section("system", "NORMAL")).diagnosis.next == on_cpu.next


def short_run(sampled_ranks: tuple[int, ...], world_size: int) -> RunData:
    """20 steps of 10 ms per rank from t=1000.0; r0 also sampled inside the steps,
    the other sampled ranks only at their start and exit."""
    meta = RunMeta(session_id="s", command=["train.py"], started_at=999.0, ended_at=1001.0,
                   exit_code=0, partial=False, world_size=world_size, missing_ranks=(),
                   nodes=(NodeInfo(0, "h", tuple(range(world_size))),), device="cpu",
                   versions={}, transport={})
    steps = tuple(step_row(r, s, 1.0, 2.0, 3.0, 4.0, 10.0, 0.0, t=1000.0 + 0.01 * (s + 1))
                  for r in range(world_size) for s in range(20))
    times = {0: (999.5, 1000.1, 1000.5)}
    process = tuple(ProcessSample(r, 0, t, 50.0, 1 << 30, 1 << 34, 8)
                    for r in sampled_ranks for t in times.get(r, (999.5, 1000.5)))
    return RunData(meta, steps, process, ())


def test_process_scope_lists_every_sampled_rank_of_a_short_run() -> None:
    run = short_run((0, 1), 2)
    section = process_section(run, select_window(run.steps, 10_000, 2))
    assert (section.scope.ranks, section.scope.missing_ranks) == ((0, 1), ())
    assert section.scope.num_samples == 3  # r0's sample inside the steps, r1's two
    assert [(p.rank, p.num_samples) for p in section.ranks
            if isinstance(p, RankProcess)] == [(0, 1), (1, 2)]


def test_process_scope_says_missing_only_of_ranks_with_no_sample() -> None:
    run = short_run((0, 2), 3)
    section = process_section(run, select_window(run.steps, 10_000, 3))
    assert (section.scope.ranks, section.scope.missing_ranks) == ((0, 2), (1,))


@pytest.mark.parametrize(("exit_code", "label", "severity"), [
    (1, "ENDED BEFORE THE FIRST STEP", "crit"),  # the set-up raised
    (0, "ENDED BEFORE THE FIRST STEP", "info"),  # nothing that looks like training ran
    (None, "STEP TIME NOT MEASURED", "info"),  # still running: nothing ended yet
])
def test_a_run_without_a_single_step_is_headlined_by_its_ending(
        exit_code: int | None, label: str, severity: str) -> None:
    import dataclasses

    from tests.live.conftest import fixed_run
    from traceml.report.build import build_report

    run = fixed_run()
    run = dataclasses.replace(run, steps=(), meta=dataclasses.replace(run.meta,
                                                                      exit_code=exit_code))
    report = build_report(run, 10000)
    if exit_code is None:  # still running: nothing ended yet
        assert report.ending.state == "running" and report.ending.headline is None
        assert report.primary.section != "ending"
        finding = report.step_time.diagnosis
    else:  # the ending is the run's headline; Step Time says what it measured
        assert report.ending.state == "no_steps" and report.primary.section == "ending"
        assert report.step_time.diagnosis.label == "STEP TIME NOT MEASURED"
        finding = report.primary.finding
    assert (finding.label, finding.severity) == (label, severity)


def _sampled_gpu_run(world_size: int, device: str) -> RunData:
    """60 steps per rank; on CUDA rank r's GPU time is 10+r ms on every 4th step,
    the rest untimed (and 0 ms of GPU time would be wrong for them)."""
    meta = RunMeta(session_id="s", command=[], started_at=0.0, ended_at=10.0, exit_code=0,
                   partial=False, world_size=world_size, missing_ranks=(),
                   nodes=(NodeInfo(0, "h", tuple(range(world_size))),), device=device,
                   versions={}, transport={})
    on_cuda = device == "cuda"
    steps = tuple(
        step_row(r, s, 1.0, 3.0, 5.0, 1.0, 12.0, 2.0,
                 peak_allocated_bytes=1000 if on_cuda and s % 4 == 0 else None,
                 gpu_ms=10.0 + r if on_cuda and s % 4 == 0 else None)
        for r in range(world_size) for s in range(60))
    return RunData(meta, steps, (), ())


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_gpu_time_stats_use_only_the_steps_that_carry_gpu_times(world_size: int) -> None:
    from traceml.report import build_report, render_text, report_to_json, validate_summary

    report = build_report(_sampled_gpu_run(world_size, "cuda"), summary_window_rows=10_000)
    doc = report_to_json(report)
    assert validate_summary(doc) == []
    step_time = doc["step_time"]
    assert isinstance(step_time, dict)
    window = select_window(_sampled_gpu_run(world_size, "cuda").steps, 10_000, world_size)
    expected = sum(1 for s in window.steps if s % 4 == 0)
    for row in step_time["ranks"]:
        assert row["num_steps"] == 55 and row["num_gpu_timed_steps"] == expected
        assert row["gpu_ms"]["count"] == expected
        assert row["gpu_ms"]["mean"] == 10.0 + row["rank"]  # untimed steps left out
    stat = step_time["stats"]["gpu_ms"]
    assert stat["worst"] == 10.0 + world_size - 1
    card = " ".join(line.strip("| ") for line in render_text(report).splitlines())
    assert f"(forward+backward+optimizer), from {expected} of 55 steps (those timed)" in card


def test_gpu_time_is_null_off_cuda() -> None:
    from traceml.report import build_report, render_text, report_to_json

    report = build_report(_sampled_gpu_run(2, "cpu"), summary_window_rows=10_000)
    doc = report_to_json(report)
    step_time = doc["step_time"]
    assert isinstance(step_time, dict)
    assert step_time["stats"]["gpu_ms"] is None
    assert all(r["gpu_ms"] is None and r["num_gpu_timed_steps"] is None
               for r in step_time["ranks"])
    assert "GPU time" not in render_text(report)
