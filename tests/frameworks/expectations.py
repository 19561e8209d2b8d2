"""What every framework run must show in the store: the shared end-to-end assertions."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunResult, run_traceml
from traceml import phases

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PHASES = tuple(p.column for p in phases.PHASES)  # the stored phase columns
EVAL_ROWS = 16
EVAL_SLEEP_MS = 40.0  # per evaluation row: an evaluation loop takes hundreds of ms
AFTER_EVAL_SLEEP_MS = 300.0  # work after each evaluation loop (metrics, checkpoint)
INPUT_SLEEP_MS_PER_STEP = 40.0  # the input-bound variant's fetch time per micro-batch
AFTER_STEP_SLEEP_MS = 150.0  # a user callback's work after TraceMLCallback ended the step


def run_script(tmp_path: Path, name: str, *args: str, nproc: int = 1,
               env: dict[str, str] | None = None) -> RunResult:
    """``traceml run [--nproc-per-node=N] scripts/NAME ARGS``; the run must succeed."""
    launch = [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    res = run_traceml(tmp_path, "run", *launch, str(SCRIPTS / name), *args, env=env,
                      timeout=150)
    assert res.returncode == 0, res.stderr[-4000:]
    assert set(res.evidence()) == set(range(nproc)), res.stderr[-4000:]
    assert {s["rank"] for s in res.steps} == set(range(nproc)), res.stderr[-4000:]
    return res


def eval_args(num_steps: int, accum: int, batch: int) -> list[str]:
    """Script options: ``num_steps`` optimizer steps, a slow evaluation every 3."""
    return ["--steps", str(num_steps), "--accum", str(accum), "--batch", str(batch),
            "--eval-every", "3", "--eval-rows", str(EVAL_ROWS),
            "--eval-sleep-ms", str(EVAL_SLEEP_MS), "--after-eval-sleep-ms", str(AFTER_EVAL_SLEEP_MS)]


def assert_one_step_per_optimizer_step(res: RunResult, num_steps: int, accum: int) -> None:
    """As many traceml steps as the framework's optimizer steps; accum micro-batches each."""
    for rank, evidence in res.evidence().items():
        steps = res.steps_of(rank)
        assert evidence["optimizer_steps"] == num_steps
        assert [s["step"] for s in steps] == list(range(num_steps)), rank
        for s in steps:
            counts = (s["num_forward"], s["num_backward"], s["num_optimizer"])
            assert counts == (accum, accum, 1), (rank, s)
            assert s["num_input"] >= accum, (rank, s)


def assert_phases_add_up(res: RunResult) -> None:
    """input + forward + backward + optimizer + wait == total, wait never negative."""
    assert res.steps
    for s in res.steps:
        phases = sum(s[p] for p in PHASES)
        assert s["wait_ms"] >= 0
        assert phases <= s["total_ms"] + 1e-6, s
        assert phases + s["wait_ms"] == pytest.approx(s["total_ms"], rel=1e-6, abs=1e-6)


def assert_evaluation_kept_out(res: RunResult, world_size: int = 1) -> None:
    """Evaluation ran, and no training step absorbed the evaluation loop (each rank
    evaluates its share of the rows) nor the work after it."""
    assert all(e["evaluations"] > 0 for e in res.evidence().values())
    smallest_ms = min(EVAL_ROWS / world_size * EVAL_SLEEP_MS, AFTER_EVAL_SLEEP_MS)
    # The step the FLOP counter ran in is several times slower in forward and
    # backward (the summary leaves it out of its window): there, only the time
    # outside the model may not hold the evaluation.  Its forward count is
    # checked with the others (accum, never the evaluation's batches).
    timed = [s for s in res.steps if not s["flops_counted"]]
    counted = [s for s in res.steps if s["flops_counted"]]
    assert len(counted) <= len(res.evidence()), counted  # one count per rank at most
    worst_total = max(s["total_ms"] for s in timed)
    worst_outside = max((s["total_ms"] - s["forward_ms"] - s["backward_ms"] for s in counted),
                        default=0.0)
    worst_input = max(s["input_ms"] for s in res.steps)
    assert worst_total < smallest_ms / 2, (worst_total, smallest_ms)
    assert worst_outside < smallest_ms / 4, (worst_outside, smallest_ms)
    assert worst_input < smallest_ms / 4, (worst_input, smallest_ms)


def callback_args() -> list[str]:
    """TraceMLCallback first, then a user callback that works after each step."""
    return ["--callback", "--after-step-sleep-ms", str(AFTER_STEP_SLEEP_MS)]


def assert_steps_end_at_the_callback(res: RunResult) -> None:
    """With TraceMLCallback the work of later callbacks is outside the steps."""
    worst_wait = max(s["wait_ms"] for s in res.steps)
    assert worst_wait < AFTER_STEP_SLEEP_MS / 2, worst_wait


def assert_input_bound(res: RunResult) -> None:
    """The slow dataset dominates the steps, and the summary says INPUT-BOUND."""
    share = statistics.median(s["input_ms"] / s["total_ms"] for s in res.steps)
    assert share > 0.5, share
    summary: dict[str, Any] = json.loads((res.session_dir / "final_summary.json").read_text())
    assert summary["step_time"]["diagnosis"]["label"] == "INPUT-BOUND", summary["step_time"]


# -- the scenarios every framework runs (each test file names its script) ----


def check_steps_with_evaluation(tmp_path: Path, script: str, batch: int, accum: int,
                                callback: bool = False) -> RunResult:
    """9 optimizer steps with a slow evaluation every 3: one traceml step per
    optimizer step, phases adding up, evaluation kept out of the steps."""
    res = run_script(tmp_path, script, *eval_args(9, accum, batch),
                     *(callback_args() if callback else []))
    assert_one_step_per_optimizer_step(res, num_steps=9, accum=accum)
    assert_phases_add_up(res)
    assert_evaluation_kept_out(res)
    if callback:
        assert_steps_end_at_the_callback(res)
    return res


def check_ddp_two_ranks(tmp_path: Path, script: str, batch: int) -> RunResult:
    """The same on 2 gloo ranks, each evaluating its half of the rows."""
    res = run_script(tmp_path, script, *eval_args(6, 2, batch), nproc=2)
    assert all(e["world_size"] == 2 for e in res.evidence().values())
    assert_one_step_per_optimizer_step(res, num_steps=6, accum=2)
    assert_phases_add_up(res)
    assert_evaluation_kept_out(res, world_size=2)
    return res


def check_slow_dataset_is_input_bound(tmp_path: Path, script: str, batch: int) -> RunResult:
    res = run_script(tmp_path, script, "--steps", "12", "--batch", str(batch),
                     "--input-sleep-ms", str(INPUT_SLEEP_MS_PER_STEP / batch))
    assert_one_step_per_optimizer_step(res, num_steps=12, accum=1)
    assert_input_bound(res)
    return res
