"""The compare verdict on hand-built summaries: noise, thresholds, memory, MIXED,
INCONCLUSIVE. Summaries are built the real way (RunData -> build_report -> JSON), so
the per-rank quantiles the noise gate reads come from the report code itself."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.rows import step_row
from traceml.compare.build import compare_runs
from traceml.compare.model import Comparison
from traceml.compare.summary import decode_summary
from traceml.compare.verdict import decide, exceeds, leading_phase, noise_ms, step_signal
from traceml.diagnosis.stats import Distribution
from traceml.records import NodeInfo, ProcessSample, RunData, RunMeta, SystemSample
from traceml.records_json import from_jsonable
from traceml.report import build_report, report_to_json, validate_summary
from traceml.report.model import SCHEMA_VERSION

MIB = 1024**2
GIB = 1024**3
NUM_STEPS = 60  # 5 warm-up steps left out
SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"


def tight(center_ms: float) -> list[float]:
    """Per-step totals with a small spread (IQR about 1 ms)."""
    return [center_ms + d for d in (-1.0, 0.0, 1.0, 0.5, -0.5)]


def wide(center_ms: float) -> list[float]:
    """Per-step totals with a wide spread (IQR about 40 % of the center)."""
    return [center_ms * f for f in (0.6, 0.8, 1.0, 1.2, 1.4)]


def run_data(totals: Sequence[float], *, input_ms: float = 5.0, world: int = 1,
             session: str = "a", rss_bytes: int = GIB, rss_step_bytes: int = 0,
             reserved_bytes: int | None = None, device: str = "cpu", mode: str = "run",
             outlier_ms: float = 0.0, samples: int | None = 32) -> RunData:
    """A run whose steps cycle through ``totals``; input takes ``input_ms`` of each step,
    and each step consumes ``samples`` samples.

    ``rss_step_bytes`` makes host RSS grow every step (creep); ``outlier_ms`` adds that
    much to one step in the middle of the window (a garbage-collection pause)."""
    meta = RunMeta(
        session_id=session, command=["train.py"], started_at=1_767_225_600.0,
        ended_at=1_767_225_660.0, exit_code=0, partial=False, world_size=world,
        missing_ranks=(), nodes=(NodeInfo(0, "box", tuple(range(world))),), device=device,
        versions={"traceml": "0.1.0", "torch": "2.5.1", "python": "3.11.7"},
        transport={"sent": 10, "dropped": 0, "gaps": 0, "rejected": 0}, mode=mode,
    )
    steps = []
    for rank in range(world):
        for s in range(NUM_STEPS if mode == "run" else 0):
            total = totals[s % len(totals)] + (outlier_ms if s == NUM_STEPS // 2 else 0.0)
            rest = total - input_ms
            steps.append(step_row(rank, s, input_ms, 0.3 * rest, 0.6 * rest, 0.1 * rest, total,
                                 0.0, reserved_bytes, reserved_bytes,
                                 rss_bytes + s * rss_step_bytes, t=meta.started_at + s,
                                 samples=samples))
    process = tuple(ProcessSample(r, 0, meta.started_at + t, 90.0, rss_bytes, 64 * GIB, 8)
                    for r in range(world) for t in range(0, 60, 5))
    system = tuple(SystemSample(0, "box", meta.started_at + t, 40.0, 30.0, 64 * GIB)
                   for t in range(0, 60, 5))
    return RunData(meta, tuple(steps), process, system)


def summary(totals: Sequence[float], **kwargs: Any) -> dict[str, Any]:
    """final_summary.json data of :func:`run_data`, as a reader of the file sees it."""
    doc = json.loads(json.dumps(report_to_json(build_report(run_data(totals, **kwargs), 10_000))))
    assert validate_summary(doc) == []
    return dict(doc)


def compare(a: dict[str, Any], b: dict[str, Any], threshold_pct: float = 5.0) -> Comparison:
    return compare_runs(decode_summary(a, "a", "a.json"), decode_summary(b, "b", "b.json"),
                        threshold_pct)


def scenario(name: str) -> dict[str, Any]:
    run = from_jsonable(json.loads((SCENARIOS / name / "run.json").read_text()))
    return dict(json.loads(json.dumps(report_to_json(build_report(run, 10_000)))))


# --- noise -------------------------------------------------------------------------


def test_equal_medians_with_wide_spread_is_no_change() -> None:
    a = summary(wide(100.0))
    b = summary(list(reversed(wide(100.0))), session="b")
    result = compare(a, b)
    assert result.verdict.label == "NO CHANGE"
    # IQR 40 ms over 55 steps: each median is uncertain by ~5 ms, the gate is 3 * 5 * sqrt(2)
    assert result.time.noise_ms == pytest.approx(21.2, abs=0.5)


def test_slower_median_inside_a_wide_spread_is_no_change() -> None:
    result = compare(summary(wide(100.0)), summary(wide(108.0)))
    assert result.time.delta_pct == pytest.approx(8.0, abs=0.5)  # past the 5 % threshold
    assert result.verdict.label == "NO CHANGE"
    assert "within the runs' step-to-step noise (22.1 ms)" in result.verdict.why


def test_ten_percent_slower_with_tight_spread_is_regression() -> None:
    result = compare(summary(tight(100.0)), summary(tight(110.0), input_ms=15.0))
    assert result.verdict.label == "REGRESSION"
    assert result.time.direction == "worse"
    assert result.verdict.why.startswith("Step time rose 10.0% (100.0 -> 110.0 ms per step)")
    assert "most of it is input time (+10.0 ms)" in result.verdict.why


def test_ten_percent_faster_with_tight_spread_is_improvement() -> None:
    result = compare(summary(tight(110.0), input_ms=15.0), summary(tight(100.0)))
    assert result.verdict.label == "IMPROVEMENT"
    assert "Step time fell 9.1%" in result.verdict.why
    assert "input time (-10.0 ms)" in result.verdict.why


def test_fixed_straggler_names_its_input_not_the_peers_communication() -> None:
    # 2 ranks, medians over ranks: r1's input fell 10 ms and r0, which waited for it in
    # the all-reduce, 10.6 ms of communication; the cause is the input.
    a = {"input_ms": 5.3, "communication_ms": 6.0, "forward_ms": 20.0}
    b = {"input_ms": 0.2, "communication_ms": 0.7, "forward_ms": 20.1}
    assert leading_phase(a, b, -10.0) == ("input", pytest.approx(-5.1))


def test_faster_network_names_communication() -> None:
    a = {"input_ms": 0.3, "communication_ms": 8.0, "forward_ms": 20.0}
    b = {"input_ms": 0.2, "communication_ms": 2.0, "forward_ms": 19.0}
    assert leading_phase(a, b, -7.0) == ("communication", pytest.approx(-6.0))
    assert leading_phase(a, b, +1.0) == (None, None)


def test_change_below_the_relative_threshold_is_no_change() -> None:
    a, b = summary(tight(100.0)), summary(tight(104.0))
    assert compare(a, b).verdict.label == "NO CHANGE"
    assert "within the 5% threshold" in compare(a, b).verdict.why
    assert compare(a, b, threshold_pct=3.0).verdict.label == "REGRESSION"


def test_a_few_slow_steps_are_outliers_not_a_change() -> None:
    a = summary(tight(100.0))
    b = summary(tight(100.0), outlier_ms=600.0)  # one 0.6 s pause in 55 steps
    assert b["step_time"]["ranks"][0]["num_outlier_steps"] == 1  # kept out of the typical step
    assert "OUTLIER STEPS" in [f["label"] for f in b["step_time"]["findings"]]
    assert compare(a, b).verdict.label == "NO CHANGE"


def test_a_few_slow_steps_move_an_older_summarys_mean_but_are_no_change() -> None:
    a = summary(tight(100.0))
    b = summary(tight(100.0), outlier_ms=600.0)  # one 0.6 s pause in 55 steps
    # Before schema 1.2 the mean had the pause in it.
    b["schema_version"] = "1.1"
    row = b["step_time"]["ranks"][0]
    row["total_ms"]["mean"] += 600.0 / row["num_steps"]
    result = compare(a, b)
    assert result.time.delta_pct is not None and result.time.delta_pct > 10.0
    assert not result.time.median_moved
    assert result.verdict.label == "NO CHANGE"
    assert "a few slow steps, not the typical step" in result.verdict.why


def test_a_median_flipping_between_two_modes_is_no_change() -> None:
    a = summary([100.0] * 11 + [120.0] * 9)  # bimodal: the median sits on the fast mode...
    b = summary([100.0] * 9 + [120.0] * 11)  # ...and here on the slow one
    result = compare(a, b)
    assert result.time.a_p50_ms == 100.0 and result.time.b_p50_ms == 120.0
    assert result.verdict.label == "NO CHANGE"
    assert "within the 5% threshold" in result.verdict.why


def test_identical_runs_are_no_change() -> None:
    doc = scenario("healthy")
    assert compare(doc, doc).verdict.label == "NO CHANGE"


def test_step_signal_is_the_median_over_ranks() -> None:
    dists = [Distribution(n, m, m - 2, m - 1, m - 0.5, m + 1, m + 2)
             for n, m in ((100, 10.0), (400, 20.0), (100, 90.0))]
    sig = step_signal(dists)
    assert sig is not None
    assert (sig.mean_ms, sig.p50_ms, sig.iqr_ms, sig.num_steps) == (20.0, 19.5, 2.0, 100)
    assert sig.median_se_ms == pytest.approx(1.2533 * (2.0 / 1.349) / 10.0)
    assert step_signal([]) is None


def test_noise_gate_narrows_with_more_steps() -> None:
    few = step_signal([Distribution(25, 100.0, 90.0, 95.0, 100.0, 105.0, 110.0)])
    many = step_signal([Distribution(2500, 100.0, 90.0, 95.0, 100.0, 105.0, 110.0)])
    assert few is not None and many is not None
    assert noise_ms(few, few) == pytest.approx(10 * noise_ms(many, many))
    assert noise_ms(few, few) == pytest.approx(3.0 * 2**0.5 * 1.2533 * (10.0 / 1.349) / 5.0)


def test_exceeds_needs_both_gates() -> None:
    assert exceeds(6.0, 5.0, 2.0) and exceeds(-6.0, 5.0, 2.0)
    assert not exceeds(6.0, 5.0, 7.0)
    assert not exceeds(4.0, 5.0, 1.0)


# --- memory, MIXED ----------------------------------------------------------------


def test_memory_growth_is_a_regression_of_its_own() -> None:
    result = compare(summary(tight(100.0)), summary(tight(100.0), rss_bytes=GIB + GIB // 2))
    assert result.time.direction == "same"
    assert result.memory.direction == "worse"
    assert result.verdict.label == "REGRESSION"
    assert result.verdict.why.startswith("Peak host RSS grew 50.0% (1.0 GiB -> 1.5 GiB)")


def test_small_memory_change_is_no_change() -> None:
    result = compare(summary(tight(100.0)), summary(tight(100.0), rss_bytes=GIB + 40 * MIB))
    assert result.memory.direction == "same"
    assert result.verdict.label == "NO CHANGE"


def test_faster_but_more_memory_is_mixed() -> None:
    result = compare(summary(tight(110.0)), summary(tight(90.0), rss_bytes=2 * GIB))
    assert result.verdict.label == "MIXED"
    assert " but peak host RSS grew 100.0%" in result.verdict.why


def test_creep_appearing_is_memory_growth_even_below_the_peak_gate() -> None:
    a = summary(tight(100.0), rss_bytes=2 * GIB)
    b = summary(tight(100.0), rss_bytes=1400 * MIB, rss_step_bytes=10 * MIB)  # peak ~2.0 GiB
    result = compare(a, b)
    assert b["step_memory"]["diagnosis"]["kind"] == "RSS_CREEP"
    assert (result.memory.direction, result.verdict.label) == ("worse", "REGRESSION")
    assert result.verdict.why.startswith("Host RSS creep appeared in B; step time moved")
    assert compare(b, a).verdict.label == "IMPROVEMENT"


def test_device_memory_decides_before_host_rss() -> None:
    a = summary(tight(100.0), reserved_bytes=4 * GIB, device="cuda")
    b = summary(tight(100.0), reserved_bytes=6 * GIB, device="cuda")
    result = compare(a, b)
    assert (result.memory.metric, result.verdict.label) == ("peak_reserved_bytes", "REGRESSION")


def test_gpu_memory_creep_scenario_is_a_regression() -> None:
    assert compare(scenario("healthy"), scenario("gpu_memory_creep")).verdict.label == "REGRESSION"


def test_cpu_only_runs_compare_fully() -> None:
    result = compare(summary(tight(100.0)), summary(tight(100.0)))
    assert result.verdict.label == "NO CHANGE"
    assert not any(s.inconclusive for s in result.sections)
    memory = next(s for s in result.sections if s.name == "step_memory")
    assert [r.key for r in memory.rows] == ["rss_peak_bytes", "rss_growth_bytes"]


# --- INCONCLUSIVE, notes --------------------------------------------------------------


def test_missing_step_time_section_is_inconclusive_not_a_crash() -> None:
    b = summary(tight(100.0))
    del b["step_time"]
    result = compare(summary(tight(100.0)), b)
    assert result.verdict.label == "INCONCLUSIVE"
    step_time = result.sections[0]
    assert (step_time.name, step_time.inconclusive_why) == ("step_time", "missing in B")
    assert result.verdict.why.startswith("Step time could not be compared: B has no Step Time")


def test_missing_memory_section_leaves_the_time_verdict() -> None:
    a = summary(tight(100.0))
    for name in ("step_memory", "system"):
        del a[name]
    result = compare(a, summary(tight(110.0)))
    assert result.verdict.label == "REGRESSION"
    status = {s.name: s.inconclusive_why for s in result.sections}
    assert status == {"step_time": None, "step_memory": "missing in A", "process": None,
                      "system": "missing in A", "throughput": None}


def test_watch_run_is_inconclusive() -> None:
    result = compare(summary(tight(100.0)), summary([], mode="watch"))
    assert result.verdict.label == "INCONCLUSIVE"
    assert result.sections[0].inconclusive_why == "not measured in B"


def test_missing_quantiles_are_inconclusive() -> None:
    b = summary(tight(100.0))
    for row in b["step_time"]["ranks"]:
        del row["total_ms"]
    assert compare(summary(tight(100.0)), b).time.direction == "unknown"


def test_schema_version_and_world_size_differences_are_stated() -> None:
    b = summary(tight(100.0), world=2)
    b["schema_version"] = "1.99"
    result = compare(summary(tight(100.0)), b)
    assert result.verdict.label == "NO CHANGE"
    assert result.notes == (
        (f"Summary schema versions differ (A {SCHEMA_VERSION}, B 1.99); values only one side "
         "has are not compared."),
        "World sizes differ (A 1 rank, B 2 ranks); values are medians over ranks.",
    )


def test_a_busy_machine_is_stated() -> None:
    b = scenario("cpu_pressure_2n")
    result = compare(scenario("healthy"), b)
    assert ("B's machine was under CPU or RAM pressure (see System); other load there can "
            "move step times.") in result.notes


@pytest.mark.parametrize(("time", "memory", "label"), [
    ("same", "same", "NO CHANGE"),
    ("same", "unknown", "NO CHANGE"),
    ("worse", "same", "REGRESSION"),
    ("same", "worse", "REGRESSION"),
    ("worse", "worse", "REGRESSION"),
    ("better", "unknown", "IMPROVEMENT"),
    ("same", "better", "IMPROVEMENT"),
    ("better", "worse", "MIXED"),
    ("worse", "better", "MIXED"),
    ("unknown", "same", "INCONCLUSIVE"),
    ("unknown", "unknown", "INCONCLUSIVE"),
    ("unknown", "worse", "REGRESSION"),
])
def test_decide(time: Any, memory: Any, label: str) -> None:
    assert decide(time, memory) == label


@pytest.mark.parametrize("state", ["stalled", "crashed"])
def test_a_stalled_or_crashed_run_is_not_compared_for_speed(state: str) -> None:
    # B's steps look twice as fast, but B stopped: that is no speed-up.
    b = summary(tight(50.0))
    b["ending"]["state"] = state
    b["ending"]["headline"] = dict(b["primary"], label=state.upper())
    result = compare(summary(tight(100.0)), b)
    assert result.time.direction == "unknown"
    assert result.verdict.label != "IMPROVEMENT"
    assert (f"step time is not compared: B {state} ({state.upper()}), so its steps do not say "
            "how fast the job trains") in result.time.why
