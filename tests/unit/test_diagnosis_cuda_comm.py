"""COMMUNICATION-BOUND on CUDA from the GPU's wait on DDP's collectives
(``gpu_communication_ms``), on hand-built 1-, 2- and 8-rank windows whose ranks
time a random sample of their own steps, as the CUDA path does."""

from __future__ import annotations

import random

import pytest

from tests.rows import row_of
from traceml.diagnosis.step_time import RankStepTimes, diagnose_step_time, rank_step_times
from traceml.diagnosis.window import select_window
from traceml.records import StepRow

STEPS = 200


def cuda_rank(rank: int, host: dict[str, float], gpu: dict[str, float] | None,
              every: int = 6, seed: int = 0, first_timed: int = 25) -> list[StepRow]:
    """``STEPS`` steps of one CUDA rank: host phase times ``host`` (ms, ``wait`` the
    untraced rest); on the first ``first_timed`` steps and one random step in each
    block of ``every`` after them, the GPU times ``gpu`` (``forward``, ``backward``
    with the wait taken out, ``optimizer``, ``communication``: the wait)."""
    rng = random.Random(seed * 1000 + rank)
    timed = set(range(1, first_timed))
    timed |= {b + rng.randrange(every) for b in range(first_timed, STEPS, every)}
    total = sum(host.values())
    phase_ms = {k: v for k, v in host.items() if k != "wait"}
    rows = []
    for step in range(STEPS):
        columns = {}
        if gpu is not None and step in timed:
            columns = {f"gpu_{name}_ms": ms for name, ms in gpu.items()}
        rows.append(row_of(rank, step, phase_ms, total, host.get("wait", 0.0),
                           peak_allocated_bytes=2**30, **columns))
    return rows


def window(rows: list[StepRow], world: int) -> dict[int, RankStepTimes]:
    return rank_step_times(select_window(rows, 100_000, world), {})


# A host that queues work ahead of its GPU (the GPU check's mostly exposed case): the
# host's step is 5.4 ms, its forward blocks when the launch queue is full.
HOST_AHEAD = {"input": 0.1, "forward": 4.2, "backward": 0.6, "optimizer": 0.2, "wait": 0.3}
EXPOSED = {"forward": 0.6, "backward": 1.1, "optimizer": 0.1, "communication": 7.8}


def kinds(times: dict[int, RankStepTimes]) -> list[str]:
    return [f.kind for f in diagnose_step_time(times, device="cuda")]


def test_one_rank_waiting_on_its_all_reduce_is_communication_bound_not_compute_bound() -> None:
    times = window(cuda_rank(0, HOST_AHEAD, EXPOSED), 1)
    top = diagnose_step_time(times, device="cuda")[0]
    assert (top.kind, top.severity) == ("COMMUNICATION_BOUND", "crit")
    # Of the GPU's 9.6 ms (longer than the host's 5.4 ms step): 7.8 ms waiting.
    assert top.evidence["communication_share_pct"] == pytest.approx(100 * 7.8 / 9.6)
    assert top.evidence["step_ms"] == pytest.approx(9.6)
    assert "the GPU waited on collectives" in top.why
    assert "COMPUTE_BOUND" not in kinds(times)
    assert times[0].json_fields()["gpu_communication_ms"].mean == pytest.approx(7.8)


@pytest.mark.parametrize("world", [2, 8])
def test_every_rank_waiting_is_communication_bound_over_the_hosts_step(world: int) -> None:
    # GPU-bound: the host's step (20 ms) is the GPU's, which the timed phases
    # (1.5 + 8.0 + 0.5 + 6.0 ms) do not fill; 6 ms of it waiting: 30 %.
    host = {"input": 0.2, "forward": 1.0, "backward": 17.0, "optimizer": 1.5, "wait": 0.3}
    gpu = {"forward": 1.5, "backward": 8.0, "optimizer": 0.5, "communication": 6.0}
    rows = [r for rank in range(world) for r in cuda_rank(rank, host, gpu)]
    times = window(rows, world)
    found = diagnose_step_time(times, device="cuda")
    top = found[0]
    assert (top.kind, top.severity) == ("COMMUNICATION_BOUND", "crit")
    assert top.evidence["communication_share_pct"] == pytest.approx(30.0)
    assert sorted(top.ranks) == list(range(world))
    assert "COMMUNICATION NOT MEASURED" not in [f.label for f in found]
    assert "on the rank that waited least on average" in top.why


def test_a_gpu_stragglers_victims_do_not_make_communication_bound_up() -> None:
    # r1's GPU computes 6 ms longer (its wait 1 ms: the collectives' own cost); r0
    # waits those 6 ms too.  1 of a 20 ms step: not communication-bound.
    host = {"input": 0.2, "forward": 1.0, "backward": 17.0, "optimizer": 1.5, "wait": 0.3}
    r0 = {"forward": 1.5, "backward": 8.0, "optimizer": 0.5, "communication": 7.0}
    r1 = {"forward": 1.5, "backward": 14.0, "optimizer": 0.5, "communication": 1.0}
    times = window(cuda_rank(0, host, r0) + cuda_rank(1, host, r1), 2)
    assert "COMMUNICATION_BOUND" not in kinds(times)


def test_an_input_bound_host_makes_the_gpus_wait_a_small_share() -> None:
    # The host's 40 ms step is mostly input; the GPU's 10 ms hold 3 ms of waiting.
    host = {"input": 30.0, "forward": 4.0, "backward": 4.0, "optimizer": 1.5, "wait": 0.5}
    gpu = {"forward": 2.0, "backward": 4.5, "optimizer": 0.5, "communication": 3.0}
    times = window(cuda_rank(0, host, gpu) + cuda_rank(1, host, gpu), 2)
    found = kinds(times)
    assert found[0] == "INPUT_BOUND"
    assert "COMMUNICATION_BOUND" not in found


def test_too_few_timed_steps_on_one_rank_leave_communication_not_measured() -> None:
    # r1 timed its wait on 4 of the window's steps (its first steps only): the rule
    # says nothing rather than reading r0 alone.
    rows = cuda_rank(0, HOST_AHEAD, EXPOSED)
    few = cuda_rank(1, HOST_AHEAD, EXPOSED, every=10**6, first_timed=0)
    keep = {s for s in range(STEPS - 4, STEPS)}
    rows += [r if r.step not in keep else cuda_rank(1, HOST_AHEAD, EXPOSED, every=1)[r.step]
             for r in few]
    times = window(rows, 2)
    assert times[1].gpu_communication is not None and times[1].gpu_communication.count == 4
    labels = [f.label for f in diagnose_step_time(times, device="cuda")]
    assert "COMMUNICATION-BOUND" not in labels
    assert "COMMUNICATION NOT MEASURED" in labels


def test_without_a_ddp_model_cuda_communication_stays_not_measured() -> None:
    gpu = {"forward": 0.6, "backward": 1.1, "optimizer": 0.1}  # no wait timed
    times = window(cuda_rank(0, HOST_AHEAD, gpu) + cuda_rank(1, HOST_AHEAD, gpu), 2)
    assert times[0].gpu_communication is None
    assert times[0].json_fields()["gpu_communication_ms"] is None
    assert "COMMUNICATION NOT MEASURED" in [f.label for f in
                                            diagnose_step_time(times, device="cuda")]


def test_the_summary_and_the_card_carry_the_gpus_wait_and_in_flight() -> None:
    """A 2-rank CUDA DDP run's summary end to end (built, validated, rendered): the
    rank rows' GPU wait and in flight, the card's line for them, the verdict."""
    from traceml.records import NodeInfo, RunData, RunMeta
    from traceml.report import build_report, render_text, report_to_json, validate_summary

    meta = RunMeta(session_id="ddp", command=["train.py"], started_at=1_767_225_600.0,
                   ended_at=1_767_225_700.0, exit_code=0, partial=False, world_size=2,
                   missing_ranks=(), nodes=(NodeInfo(0, "gpu-box", (0, 1)),), device="cuda",
                   versions={"traceml": "0.1.0", "torch": "2.11.0", "python": "3.12.3"},
                   transport={"sent": 10, "dropped": 0, "gaps": 0, "rejected": 0})
    gpu = EXPOSED | {"collective": 8.1}
    rows = [r.replace(t_begin=meta.started_at + r.step * 0.0054 + 1.0)
            for rank in (0, 1) for r in cuda_rank(rank, HOST_AHEAD, gpu)]
    summary = report_to_json(build_report(RunData(meta, tuple(rows), (), ()), 100_000))
    validate_summary(summary)
    step_time = summary["step_time"]
    assert step_time["diagnosis"]["kind"] == "COMMUNICATION_BOUND"
    row = step_time["ranks"][0]
    assert row["gpu_communication_ms"]["mean"] == pytest.approx(7.8)
    assert row["gpu_collective_ms"]["mean"] == pytest.approx(8.1)
    card = render_text(build_report(RunData(meta, tuple(rows), (), ()), 100_000))
    assert "GPU communication: the GPU waited on DDP's all-reduces median/worst 7.8/7.8ms" in \
        " ".join(card.replace("|", " ").split())
    assert "in flight 8.1/8.1ms" in " ".join(card.replace("|", " ").split())
