"""build_report: the primary finding, and the analysis code's import boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from traceml.diagnosis.finding import Finding, Severity, not_measured
from traceml.diagnosis.window import Scope
from traceml.report.build import choose_primary
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
        "import sys, traceml.diagnosis.samples, traceml.report, traceml.report.text; "
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
