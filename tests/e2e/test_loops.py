"""End to end, zero code: training loops without the usual pieces (no
torch.optim, no DataLoader, evaluation and predictions on batches the loop
builds itself, a slow step now and then).  Each script counts its own
iterations and evaluations: that is the ground truth the steps must match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunResult, run_traceml, script
from tests.e2e.test_capture import assert_adds_up, assert_ok

HANDMADE = script("handmade.py")


def card_text(res: RunResult) -> str:
    """The card's text with its box and line wraps taken out."""
    lines = (res.session_dir / "final_summary.txt").read_text().splitlines()
    return " ".join(" ".join(line.strip("|").split()) for line in lines)


def run(tmp_path: Path, *args: str) -> tuple[RunResult, dict[str, Any], dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    res = run_traceml(tmp_path, "run", HANDMADE, *args)
    assert_ok(res)
    assert res.summary is not None
    assert_adds_up(res)
    return res, res.evidence()[0], res.summary["step_time"]


@pytest.mark.parametrize("update", ["manual", "manual-clip"])
def test_hand_updated_parameters_make_one_step_per_iteration(tmp_path: Path, update: str) -> None:
    # 40 iterations: more than the steps held back while no optimizer step is seen.
    res, counts, step_time = run(tmp_path, "--update", update, "--steps", "40",
                                 "--forward-ms", "5")
    assert len(res.steps) == counts["iterations"] == 40
    assert all((s["num_forward"], s["num_backward"], s["num_optimizer"]) == (1, 1, 0)
               for s in res.steps)
    assert {s["boundary"] for s in res.steps} == {"backward"}
    assert step_time["scope"]["step_boundary"] == "backward"
    assert "steps: backward, no torch.optim seen" in card_text(res)


def test_evaluation_without_a_dataloader_is_kept_out_of_the_steps(tmp_path: Path) -> None:
    # Every 10 steps, 3 no-grad forwards of 5 ms on batches the loop cuts itself.
    res, counts, step_time = run(tmp_path, "--steps", "40", "--eval-every", "10",
                                 "--forward-ms", "5")
    assert len(res.steps) == counts["iterations"] == 40
    assert all(s["num_forward"] == 1 for s in res.steps)
    assert sum(s["num_eval"] for s in res.steps) == counts["evaluations"] == 3
    evals = step_time["stats"]["eval_total_ms"]
    assert evals["median"] >= 3 * 3 * 5  # 3 passes of 3 forwards sleeping 5 ms
    typical = step_time["stats"]["total_ms"]["median"]
    # A leaked evaluation (>= 15 ms) would be in the step before or after it; the
    # FLOP-counted step is slower by design.
    near = {i for n, s in enumerate(res.steps) if s["num_eval"] for i in (n - 1, n)}
    assert all(res.steps[i]["total_ms"] < typical + 3 * 5 for i in near
               if not res.steps[i]["flops_counted"]), "an evaluation leaked"
    assert step_time["diagnosis"]["label"] == "COMPUTE-BOUND", step_time["findings"]


def test_predictions_between_lbfgs_steps_are_evaluation(tmp_path: Path) -> None:
    # After each optimizer.step(closure): predict without grad, then 30 ms of plotting.
    res, counts, step_time = run(tmp_path, "--update", "lbfgs", "--steps", "20",
                                 "--predict-ms", "30", "--forward-ms", "5")
    assert len(res.steps) == counts["iterations"] == 20
    assert all(s["num_optimizer"] == 1 and s["num_forward"] == 1 for s in res.steps)
    # The prediction after the last step has no next step to end it.
    assert sum(s["num_eval"] for s in res.steps) == counts["predictions"] - 1
    assert all(s["total_ms"] < 30 + 5 for s in res.steps[1:] if not s["flops_counted"]), (
        "plotting leaked into a step")
    assert step_time["diagnosis"]["label"] == "COMPUTE-BOUND", step_time["findings"]


def test_slow_get_batch_without_a_dataloader_is_input_bound(tmp_path: Path) -> None:
    res, counts, step_time = run(tmp_path, "--steps", "40", "--batch-ms", "8",
                                 "--forward-ms", "5")
    assert len(res.steps) == counts["iterations"] == 40
    assert all(s["input_ms"] >= 7 for s in res.steps[1:])  # the first begins at its forward
    assert step_time["scope"]["input_source"] == "before_forward"
    assert step_time["diagnosis"]["label"] == "INPUT-BOUND", step_time["findings"]
    assert "DataLoader" in step_time["diagnosis"]["next"]  # ...to build batches in workers
    assert "- Input: time before the first forward; no DataLoader" in card_text(res)


def test_a_slow_step_every_50_is_an_outlier_finding_with_its_period(tmp_path: Path) -> None:
    # A 300 ms "checkpoint" after every 50th of 200 iterations of ~10 ms.
    args = ("--steps", "200", "--forward-ms", "10")
    res, counts, step_time = run(tmp_path / "slow", *args, "--slow-every", "50",
                                 "--slow-ms", "300")
    assert len(res.steps) == counts["iterations"] == 200
    outliers = step_time["diagnosis"]
    assert outliers["label"] == "OUTLIER STEPS" and res.summary is not None
    assert res.summary["primary"]["label"] == "OUTLIER STEPS"
    evidence = outliers["evidence"]
    # The pause after iteration 49 is where step 50's batch was made, and so on;
    # the one after the last iteration is in no step.  (On a busy host a step
    # the machine stalled may be an outlier too: listed apart from the period.)
    assert evidence["period_steps"] == 50 and evidence["num_outlier_steps"] >= 3
    slow = [s for s in res.steps if s["step"] in (50, 100, 150)]
    window = [s for s in res.steps[5:] if not s["flops_counted"]]  # warm-up, counted step out
    share = 100 * sum(s["total_ms"] for s in slow) / sum(s["total_ms"] for s in window)
    if evidence["num_outlier_steps"] == 3:
        assert evidence["outlier_share_pct"] == pytest.approx(share, rel=1e-6)
    assert evidence["outlier_share_pct"] >= share - 1e-6
    assert "every 50 steps (from step 50)" in outliers["why"]
    assert f"{evidence['outlier_share_pct']:.1f}% of wall time" in outliers["why"]
    # The typical step is diagnosed as the same loop without the pauses is (on a
    # quiet host COMPUTE-BOUND; a busy one may stall a few steps of its own).
    _, _, plain = run(tmp_path / "plain", *args)
    typical = typical_diagnosis(step_time)
    assert typical == typical_diagnosis(plain)
    assert step_time["stats"]["total_ms"]["median"] == pytest.approx(
        plain["stats"]["total_ms"]["median"], rel=0.25)
    assert f"- Also: {typical}" in card_text(res)


def typical_diagnosis(step_time: dict[str, Any]) -> str:
    """The first Step Time finding that is not about outlier steps."""
    return next(str(f["label"]) for f in step_time["findings"] if f["kind"] != "OUTLIER_STEPS")
