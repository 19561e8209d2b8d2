"""The rules on CUDA from the GPU's times: COMMUNICATION-BOUND from the GPU's wait on
DDP's collectives (``gpu_communication_ms``) and stragglers from the GPU's compute, on
hand-built 1-, 2- and 8-rank windows whose ranks time a random sample of their own
steps, as the CUDA path does."""

from __future__ import annotations

import random

import pytest

from tests.rows import row_of
from traceml.diagnosis.step_time import RankStepTimes, diagnose_step_time, rank_step_times
from traceml.diagnosis.window import select_window
from traceml.records import StepRow

STEPS = 200


def cuda_rank(rank: int, host: dict[str, float], gpu: dict[str, float] | None,
              every: int = 6, seed: int = 0, first_timed: int = 25,
              jitter: float = 0.0) -> list[StepRow]:
    """``STEPS`` steps of one CUDA rank: host phase times ``host`` (ms, ``wait`` the
    untraced rest); on the first ``first_timed`` steps and one random step in each
    block of ``every`` after them, the GPU times ``gpu`` (``forward``, ``backward``
    with the wait taken out, ``optimizer``, ``communication``: the wait, ``collective``:
    in flight)."""
    rng = random.Random(seed * 1000 + rank)
    timed = set(range(1, first_timed))
    timed |= {b + rng.randrange(every) for b in range(first_timed, STEPS, every)}
    total = sum(host.values())
    phase_ms = {k: v for k, v in host.items() if k != "wait"}
    rows = []
    for step in range(STEPS):
        columns = {}
        if gpu is not None and step in timed:  # each time moved by up to +-jitter of it
            columns = {f"gpu_{name}_ms": ms * (1.0 + rng.uniform(-jitter, jitter))
                       for name, ms in gpu.items()}
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
    waited = times[1].reported["gpu_communication_ms"]
    assert waited is not None and waited.count == 4
    labels = [f.label for f in diagnose_step_time(times, device="cuda")]
    assert "COMMUNICATION-BOUND" not in labels
    assert "COMMUNICATION NOT MEASURED" in labels


def test_without_a_ddp_model_cuda_communication_stays_not_measured() -> None:
    gpu = {"forward": 0.6, "backward": 1.1, "optimizer": 0.1}  # no wait timed
    times = window(cuda_rank(0, HOST_AHEAD, gpu) + cuda_rank(1, HOST_AHEAD, gpu), 2)
    assert times[0].reported["gpu_communication_ms"] is None
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


# GPU-bound ranks: every host blocks alike (its launches wait on its own GPU, which
# waits for the slowest in DDP's all-reduce), so host time names nobody.
HOST_BOUND_BY_GPU = {"input": 0.3, "forward": 1.0, "backward": 16.5, "optimizer": 1.9,
                     "wait": 0.3}
GPU_EVEN = {"forward": 4.0, "backward": 8.0, "optimizer": 1.0, "communication": 2.0}


@pytest.mark.parametrize("world", [2, 8])
def test_a_slower_gpu_backward_names_its_rank_from_the_gpus_times(world: int) -> None:
    # The last rank's backward kernels take 5 ms more (uneven shapes); the others
    # wait those 5 ms in DDP's all-reduce, which the GPU's wait takes out of backward.
    slow = world - 1
    rows = []
    for rank in range(world):
        gpu = GPU_EVEN | ({"backward": 13.0} if rank == slow else {"communication": 7.0})
        rows += cuda_rank(rank, HOST_BOUND_BY_GPU, gpu, jitter=0.05)
    times = window(rows, world)
    top = diagnose_step_time(times, device="cuda")[0]
    assert (top.kind, top.ranks) == ("COMPUTE_STRAGGLER", (slow,)), top
    assert top.why.startswith(f"r{slow} backward on the GPU was 13.")
    assert top.evidence["excess_ms"] == pytest.approx(5.0, abs=0.3)
    assert "of its GPU-timed steps" in top.why
    # The same run judged on host time alone names nobody: the hosts look alike.
    host_only = [f.kind for f in diagnose_step_time(times, device="cpu")
                 if "STRAGGLER" in f.kind]
    assert "COMPUTE_STRAGGLER" not in host_only


def test_a_gpu_slow_now_and_then_is_unclear_not_named() -> None:
    # r1's backward runs 8 ms long on about a third of its timed samples (a shared
    # host's launch contention): its mean is 2.8 ms over r0's, past the straggler
    # limit, but it is slower in only a third of its samples.
    rows = cuda_rank(0, HOST_BOUND_BY_GPU, GPU_EVEN, jitter=0.02)
    flip = random.Random(11)
    rows += [r.replace(gpu_backward_ms=r.value("gpu_backward_ms") + 8.0)
             if r.value("gpu_backward_ms") is not None and flip.random() < 0.35 else r
             for r in cuda_rank(1, HOST_BOUND_BY_GPU, GPU_EVEN, jitter=0.02)]
    found = diagnose_step_time(window(rows, 2), device="cuda")
    assert found[0].kind == "STRAGGLER_UNSTEADY", found
    assert "backward on the GPU" in found[0].why
    assert not any(f.kind == "COMPUTE_STRAGGLER" for f in found)


def test_a_slow_input_rank_on_cuda_is_an_input_straggler_of_the_gpus_step() -> None:
    # r1's loader takes 6 ms more (host: its backward launches that much less blocked);
    # the GPUs' timed phases (27 ms) are longer than the hosts' 20 ms steps: the excess
    # is graded against the GPU's step, as COMMUNICATION-BOUND's is.
    gpu = GPU_EVEN | {"backward": 20.0}
    host = {0: HOST_BOUND_BY_GPU, 1: HOST_BOUND_BY_GPU | {"input": 6.3, "backward": 10.5}}
    rows = [r for rank in (0, 1) for r in cuda_rank(rank, host[rank], gpu, jitter=0.05)]
    top = diagnose_step_time(window(rows, 2), device="cuda")[0]
    assert (top.kind, top.ranks) == ("INPUT_STRAGGLER", (1,)), top
    assert top.why.startswith("r1 input was 6.3 ms")
    assert top.evidence["step_ms"] == pytest.approx(27.0, abs=0.6)


def test_too_few_gpu_timed_steps_fall_back_to_host_time() -> None:
    # r1 has GPU times on 3 typical steps only: attribution reads host time, where
    # r1's backward (its host blocked on its slow GPU) is blamed with host wording.
    rows = cuda_rank(0, HOST_BOUND_BY_GPU, GPU_EVEN)
    slow_host = HOST_BOUND_BY_GPU | {"backward": 22.0}
    rows += [r if r.step >= STEPS - 3 else r.replace(gpu_forward_ms=None)
             for r in cuda_rank(1, slow_host, GPU_EVEN, every=1, jitter=0.05)]
    times = window(rows, 2)
    top = diagnose_step_time(times, device="cuda")[0]
    assert (top.kind, top.ranks) == ("COMPUTE_STRAGGLER", (1,)), top
    assert top.why.startswith("r1 backward was 22.0 ms vs 16.5 ms")


def test_a_gpu_forward_waiting_at_a_broadcast_is_not_blamed() -> None:
    # r1's GPU optimizer takes 5 ms more; r0's GPU forward waits those 5 ms at DDP's
    # buffer broadcast (a collective inside forward, not taken out): r1 is named, r0 not.
    r0 = GPU_EVEN | {"forward": 9.0}
    r1 = GPU_EVEN | {"optimizer": 6.0}
    rows = (cuda_rank(0, HOST_BOUND_BY_GPU, r0, jitter=0.05)
            + cuda_rank(1, HOST_BOUND_BY_GPU, r1, jitter=0.05))
    found = [f for f in diagnose_step_time(window(rows, 2), device="cuda")
             if "STRAGGLER" in f.kind]
    assert [(f.kind, f.ranks) for f in found] == [("COMPUTE_STRAGGLER", (1,))], found
    assert found[0].why.startswith("r1 optimizer on the GPU was 6.")


def test_a_host_timed_barrier_overlapping_the_gpus_wait_is_not_counted_twice() -> None:
    # A dist.barrier() each step (no tensor: timed on the host, 3 ms, waiting for the
    # GPU's queue) beside the GPU's 7.8 ms wait on DDP: 7.8 ms of communication.
    host = HOST_AHEAD | {"communication": 3.0}
    times = window(cuda_rank(0, host, EXPOSED) + cuda_rank(1, host, EXPOSED), 2)
    top = diagnose_step_time(times, device="cuda")[0]
    assert top.kind == "COMMUNICATION_BOUND"
    assert top.evidence["communication_ms"] == pytest.approx(7.8)
