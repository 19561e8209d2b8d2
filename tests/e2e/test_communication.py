"""End to end on real 2-rank gloo DDP and FSDP, zero code: communication is a
phase of its own, and a slow rank is named from its own work, never the rank
that waits for it (SPEC R-COMM-1..3)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import run_traceml, script

DELAY_MS = 15.0


def _ddp(tmp_path: Any, case: str, slow_rank: int = 1) -> Any:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("ddp_cases.py"),
                      "--case", case, "--delay-ms", str(DELAY_MS), "--steps", "30",
                      "--slow-rank", str(slow_rank))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.summary is not None and set(res.evidence()) == {0, 1}
    return res


def _stragglers(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The straggler findings that name a rank (UNCLEAR STRAGGLER names none)."""
    return [f for f in summary["step_time"]["findings"]
            if "STRAGGLER" in f["kind"] and f["ranks"]]


def _excess_ok(finding: dict[str, Any]) -> bool:
    return abs(finding["evidence"]["excess_ms"] - DELAY_MS) <= 1.0 + 0.15 * DELAY_MS


def test_rank_slow_inside_backward_is_named_with_backward(tmp_path: Any) -> None:
    summary = _ddp(tmp_path, "backward").summary
    (found,) = _stragglers(summary)
    assert (found["kind"], found["ranks"]) == ("COMPUTE_STRAGGLER", [1]), found
    assert found["why"].startswith("r1 backward was"), found["why"]
    assert _excess_ok(found), found["evidence"]
    # The fast rank's wait is communication, not its backward.
    r0 = summary["step_time"]["ranks"][0]
    assert r0["communication_ms"]["mean"] > 0.6 * DELAY_MS
    assert summary["step_time"]["diagnosis"]["kind"] == "COMPUTE_STRAGGLER"


@pytest.mark.parametrize("slow", [1, 0])
def test_rank_slow_between_steps_is_named_never_the_waiting_rank(tmp_path: Any,
                                                                 slow: int) -> None:
    summary = _ddp(tmp_path, "between", slow_rank=slow).summary
    found = _stragglers(summary)
    assert [(f["kind"], f["ranks"]) for f in found] == [("HOST_STRAGGLER", [slow])], found
    assert "untraced host work" in found[0]["why"] and _excess_ok(found[0])
    assert all(1 - slow not in f["ranks"] for f in found)


def test_slow_all_reduce_on_every_rank_is_communication_bound(tmp_path: Any) -> None:
    summary = _ddp(tmp_path, "network").summary
    step_time = summary["step_time"]
    assert step_time["diagnosis"]["kind"] == "COMMUNICATION_BOUND", step_time["findings"]
    assert _stragglers(summary) == []
    assert step_time["stats"]["communication_ms"]["median"] > DELAY_MS
    # Exposed communication is part of what was in flight.
    assert (step_time["stats"]["collective_ms"]["median"]
            >= step_time["stats"]["communication_ms"]["median"] * 0.95)


def test_balanced_run_has_no_straggler_and_times_its_all_reduce(tmp_path: Any) -> None:
    res = _ddp(tmp_path, "balanced")
    assert _stragglers(res.summary) == []
    stats = res.summary["step_time"]["stats"]
    assert stats["communication_ms"]["median"] > 0
    # torch's own C++ all-reduce stays (its buckets are not timed one by one): in
    # flight from its first bucket's launch to the end of DDP's wait.
    assert stats["collective_ms"]["median"] >= stats["communication_ms"]["median"]
    # DDP's own averaging, unchanged by the timing hook.
    assert res.evidence()[0]["grad"] == pytest.approx(res.evidence()[0]["sum_of_local_grads"] / 2)


def test_the_scripts_own_comm_hook_still_decides_the_gradients(tmp_path: Any) -> None:
    res = _ddp(tmp_path, "hook")
    for rank in (0, 1):  # the hook sums instead of averaging
        evidence = res.evidence()[rank]
        assert evidence["grad"] == pytest.approx(evidence["sum_of_local_grads"])
    stats = res.summary["step_time"]["stats"]
    assert stats["communication_ms"]["median"] > 0
    assert stats["collective_ms"]["median"] > 0  # the script's hook: each bucket a span
    assert stats["hook_ms"]["median"] > 0  # its own work before it launches: communication


def test_fsdp_steps_are_counted_with_communication_measured(tmp_path: Any) -> None:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("fsdp_loop.py"), "20")
    assert res.returncode == 0, res.stderr[-3000:]
    step_time = res.summary["step_time"]
    # 20, less 2 warm-up and the steps the FLOP counter ran in (one per rank at most)
    counted = step_time["scope"]["num_counted_steps"]
    assert [r["num_steps"] for r in step_time["ranks"]] == [18 - counted] * 2 and counted <= 2
    assert step_time["stats"]["communication_ms"]["median"] > 0
    assert step_time["stats"]["collective_ms"]["median"] > 0
    assert all(s["num_communication"] > 0 for s in res.steps_of(0))
