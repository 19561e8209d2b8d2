"""End to end: `traceml run` on tiny CPU training loops that never import
traceml; real torch elastic launch, real ZeroMQ, real SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RunResult, run_traceml, script
from traceml import phases

LOOP = script("loop.py")
PHASES = tuple(p.column for p in phases.PHASES)  # the stored phase columns


def assert_ok(res: RunResult) -> None:
    assert res.returncode == 0, res.stderr[-3000:]


def assert_adds_up(res: RunResult) -> None:
    for s in res.steps:
        phases = sum(s[p] for p in PHASES)
        assert s["wait_ms"] >= 0
        assert phases + s["wait_ms"] == pytest.approx(s["total_ms"], rel=1e-6, abs=1e-6)
        assert phases <= s["total_ms"] + 1e-6


def test_single_process_zero_code(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "15")
    assert_ok(res)
    assert [s["step"] for s in res.steps] == list(range(15))
    assert all(s["num_optimizer"] == 1 and s["num_forward"] == 1 for s in res.steps)
    assert all(s["num_backward"] == 1 and s["num_input"] == 1 for s in res.steps[1:])
    assert all(s["rss_bytes"] > 10_000_000 for s in res.steps)
    assert_adds_up(res)
    assert "mean time per step" in res.stderr and "r0" in res.stderr
    assert str(res.session_dir) in res.stderr or "session folder" in res.stderr


def test_ddp_two_ranks_gloo(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", LOOP, "--steps", "12")
    assert_ok(res)
    assert set(res.evidence()) == {0, 1}
    for rank in (0, 1):
        steps = res.steps_of(rank)
        assert len(steps) == 12
        assert all(s["num_forward"] == 1 for s in steps)
    ranks = sorted(s["rank"] for s in res.senders if s["role"] == "rank")
    assert ranks == [0, 1]
    assert all(s["world_size"] == 2 and s["said_bye"] == 1
               for s in res.senders if s["role"] == "rank")
    assert_adds_up(res)


def test_gradient_accumulation_is_one_step(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "10", "--accum", "4")
    assert_ok(res)
    assert len(res.steps) == 10
    for s in res.steps:
        assert (s["num_forward"], s["num_backward"], s["num_optimizer"]) == (4, 4, 1)
    assert all(s["num_input"] == 4 for s in res.steps[1:])


def test_two_optimizers_per_iteration_is_one_step(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "10", "--gan")
    assert_ok(res)
    assert len(res.steps) == 10
    # generator forward, generator again for the discriminator input, discriminator
    assert all(s["num_optimizer"] == 2 and s["num_forward"] == 3 for s in res.steps)


@pytest.mark.parametrize("closure", ["lbfgs", "lightning"])
def test_closure_optimizer_time_excludes_forward_backward(tmp_path: Path, closure: str) -> None:
    # The model's forward sleeps 30 ms inside the closure that optimizer.step runs.
    res = run_traceml(tmp_path, "run", script("slow_forward.py"), "--closure", closure)
    assert_ok(res)
    assert len(res.steps) == 8
    for s in res.steps:
        assert s["num_forward"] >= 1 and s["num_backward"] >= 1 and s["num_optimizer"] == 1
        assert s["forward_ms"] >= 25  # the model sleeps 30 ms in forward
        assert s["optimizer_ms"] < s["forward_ms"] / 2, s  # ...which the optimizer excludes
    assert_adds_up(res)


def test_eval_loop_does_not_inflate_next_step(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", script("slow_forward.py"), "--eval-every", "3")
    assert_ok(res)
    assert len(res.steps) == 8
    for s in res.steps[1:]:
        # A training fetch takes ~32 ms and a forward ~30 ms; an eval pass adds
        # 3 more of each (~190 ms), none of which may leak into a step.
        assert s["input_ms"] < 70, s
        assert s["total_ms"] < 150, s
        assert s["num_forward"] == 1 and s["num_input"] == 1


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_stay_inert(tmp_path: Path, context: str) -> None:
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "6", "--workers", "2",
                      "--mp-context", context)
    assert_ok(res)
    workers = res.workers()
    assert len(workers) >= 2
    for w in workers:
        assert w["module_call"] == "torch.nn.modules.module.Module._wrapped_call_impl", w
        assert not w["agent_loaded"], w
    assert sorted(s["role"] for s in res.senders) == ["rank", "system"]
    assert len(res.steps) == 6


def test_torch_compile_has_no_graph_break(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", script("compiled.py"))
    assert_ok(res)
    assert "graph_breaks=0" in res.stdout, res.stdout
    assert "frames_ok=1" in res.stdout, res.stdout
    assert len(res.steps) == 6
    assert all(s["num_forward"] == 1 for s in res.steps)


@pytest.mark.parametrize("fail,code", [("raise", 1), ("exit3", 3)])
def test_user_failure_passes_through(tmp_path: Path, fail: str, code: int) -> None:
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "10", "--fail", fail)
    assert res.returncode == code, res.stderr[-2000:]
    if fail == "raise":
        assert "RuntimeError: user failure on purpose" in res.stderr
        assert 'line' in res.stderr and "loop.py" in res.stderr
    assert len(res.steps) >= 5  # captured before the failure, stored


def test_trace_step_gives_exact_boundaries(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "9", "--trace-step", "--gan")
    assert_ok(res)
    assert len(res.steps) == 9
    assert all(s["num_optimizer"] == 2 for s in res.steps)


def test_no_trace_injects_nothing(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--no-trace", script("env_dump.py"))
    assert_ok(res)
    assert not (res.session_dir / "telemetry.sqlite").exists()
    assert "TRACEML_" not in res.stdout
    assert "site_dir" not in res.stdout
