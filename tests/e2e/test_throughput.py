"""Throughput end to end: `python -m traceml run` on loops that count their own samples
and tokens and time their own steps (tests/e2e/scripts/throughput.py, zero code).

The summary's samples/s and tokens/s must equal the script's own count over its own
timer within 2 %, over the same window steps; FLOPs per step must equal the hand count;
the FLOP-counting step must be out of the window while the step count stays exact; on
CPU MFU is null and says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunResult, run_traceml, script

STEPS, BATCH = 40, 16
TOLERANCE = 0.02


def own_rate(evidence: dict[str, Any], steps: list[int], key: str) -> float:
    """The script's own count over its own timer, over ``steps``."""
    rows, end = evidence["steps"], evidence["end"]
    bounds = [r["t"] for r in rows] + [end]
    seconds = sum(bounds[i + 1] - bounds[i] for i in steps)
    return sum(rows[i][key] for i in steps) / seconds


def window_steps(result: RunResult) -> list[int]:
    """The step indices the summary's window holds: first..last without the steps counted
    on any rank (ranks may count different steps: each arms after its own warm-up)."""
    assert result.summary is not None
    scope = result.summary["throughput"]["scope"]
    counted = {r["step"] for r in result.steps if r["flops_counted"]}
    after_warmup = range(scope["num_warmup_steps"], STEPS)
    kept = [s for s in after_warmup if s not in counted]
    assert (scope["first_step"], scope["last_step"], scope["num_steps"]) == (
        kept[0], kept[-1], len(kept))
    assert scope["num_counted_steps"] == len(counted & set(after_warmup))
    return kept


def mlp_flops(batch: int, shapes: dict[str, int]) -> int:
    """2*m*n*k per matmul: forward both layers; backward the second layer's input and
    weight gradients, the first layer's weight gradient only (its input needs none)."""
    first, second = shapes["in"] * shapes["hidden"], shapes["hidden"] * shapes["out"]
    return 2 * batch * (first + second) + 2 * batch * 2 * second + 2 * batch * first


def lm_flops(batch: int, shapes: dict[str, int]) -> int:
    """The embedding is a lookup (no FLOPs); both linear layers get all three matmuls."""
    tokens = batch * shapes["seq"]
    return 3 * 2 * tokens * (shapes["dim"] * shapes["dim"] + shapes["dim"] * shapes["vocab"])


def run_case(tmp_path: Path, case: str, *extra: str, nproc: int = 1) -> RunResult:
    args = ["run", f"--nproc-per-node={nproc}", *extra, script("throughput.py"), "--case", case,
            "--steps", str(STEPS), "--batch", str(BATCH)]
    result = run_traceml(tmp_path, *args, *(["--ddp"] if nproc > 1 else []))
    assert result.returncode == 0, result.stderr
    assert result.summary is not None
    for rank in range(nproc):  # the step count stays exact: one step per iteration
        assert [r["step"] for r in result.steps if r["rank"] == rank] == list(range(STEPS))
    return result


def evidence_of(result: RunResult, rank: int) -> dict[str, Any]:
    return dict(json.loads((result.evidence_dir / f"rank{rank}.json").read_text()))


def check_counted_step(result: RunResult, rank: int) -> None:
    """One count per batch shape, after warm-up, left out of the window."""
    counted = [r["step"] for r in result.steps if r["rank"] == rank and r["flops_counted"]]
    assert counted and min(counted) >= 5, counted
    assert not set(counted) & set(window_steps(result))


def test_mlp_on_tensors_two_ddp_ranks(tmp_path: Path) -> None:
    result = run_case(tmp_path, "mlp", nproc=2)
    tp = result.summary["throughput"]  # type: ignore[index]
    rates = []
    for row in tp["ranks"]:
        rank = row["rank"]
        evidence = evidence_of(result, rank)
        own = own_rate(evidence, window_steps(result), "samples")
        assert row["samples_per_s"] == pytest.approx(own, rel=TOLERANCE)
        assert row["flops_per_step"] == pytest.approx(mlp_flops(BATCH, evidence["shapes"]),
                                                      rel=TOLERANCE)
        assert row["tokens_per_s"] is None  # float features and 1-D labels: no token ids
        check_counted_step(result, rank)
        rates.append(row["samples_per_s"])
    # the last batch is short, and counted once more (a new shape)
    assert {r["flops"] for r in result.steps if r["step"] == STEPS - 1} == {
        mlp_flops(BATCH // 2, evidence_of(result, 0)["shapes"])}
    assert tp["job"]["samples_per_s"] == pytest.approx(sum(rates))
    # CPU: achieved TFLOP/s shown, MFU null, and the report says why
    assert tp["job"]["achieved_tflops"] > 0
    assert tp["job"]["mfu_pct"] is None and all(r["mfu_pct"] is None for r in tp["ranks"])
    assert "CPU" in tp["job"]["peak_source"]
    assert "FlopCounterMode" in tp["job"]["flops_source"]
    assert "traceml: throughput per rank (summary window)\nrank    samples/s    TFLOP/s" in (
        result.stderr)


def test_token_lm_with_a_dict_batch(tmp_path: Path) -> None:
    result = run_case(tmp_path, "lm")
    row = result.summary["throughput"]["ranks"][0]  # type: ignore[index]
    evidence = evidence_of(result, 0)
    steps = window_steps(result)
    assert row["samples_per_s"] == pytest.approx(own_rate(evidence, steps, "samples"),
                                                 rel=TOLERANCE)
    assert row["tokens_per_s"] == pytest.approx(own_rate(evidence, steps, "tokens"),
                                                rel=TOLERANCE)
    assert row["tokens_per_step"] == BATCH * evidence["shapes"]["seq"]
    assert row["flops_per_step"] == pytest.approx(lm_flops(BATCH, evidence["shapes"]),
                                                  rel=TOLERANCE)
    check_counted_step(result, 0)


def test_loop_without_a_dataloader_and_no_flops(tmp_path: Path) -> None:
    result = run_case(tmp_path, "noloader", "--no-flops")
    tp = result.summary["throughput"]  # type: ignore[index]
    row = tp["ranks"][0]
    steps = window_steps(result)
    assert row["samples_per_s"] == pytest.approx(own_rate(evidence_of(result, 0), steps,
                                                          "samples"), rel=TOLERANCE)
    assert not any(r["flops_counted"] for r in result.steps)
    assert row["flops_per_step"] is None and tp["job"]["achieved_tflops"] is None
    assert tp["job"]["flops_source"] == "not counted: --no-flops"
    assert "FLOPS" in [f["label"].removesuffix(" NOT MEASURED") for f in tp["findings"]]
