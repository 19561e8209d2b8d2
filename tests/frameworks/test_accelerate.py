"""A plain loop driven by Hugging Face Accelerate under ``traceml run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks.expectations import (
    INPUT_SLEEP_MS_PER_STEP,
    assert_evaluation_kept_out,
    assert_input_bound,
    assert_one_step_per_optimizer_step,
    assert_phases_add_up,
    eval_args,
    run_script,
)

pytest.importorskip("accelerate")

pytestmark = pytest.mark.frameworks
SCRIPT = "accelerate_loop.py"
BATCH = 8


@pytest.mark.parametrize("accum", [1, 4])
def test_loop_steps_with_evaluation(tmp_path: Path, accum: int) -> None:
    res = run_script(tmp_path, SCRIPT, *eval_args(9, accum, BATCH))
    assert_one_step_per_optimizer_step(res, num_steps=9, accum=accum)
    assert_phases_add_up(res)
    assert_evaluation_kept_out(res)


def test_plain_evaluation_loader_stays_out(tmp_path: Path) -> None:
    # Accelerate's prepared loaders fetch one batch ahead, a plain DataLoader does not:
    # its last fetch (StopIteration) comes after the last evaluation forward.
    res = run_script(tmp_path, SCRIPT, *eval_args(9, 1, BATCH), "--raw-eval-loader")
    assert_one_step_per_optimizer_step(res, num_steps=9, accum=1)
    assert_evaluation_kept_out(res)


def test_ddp_two_ranks(tmp_path: Path) -> None:
    res = run_script(tmp_path, SCRIPT, *eval_args(6, 2, BATCH), nproc=2)
    assert all(e["world_size"] == 2 for e in res.evidence().values())
    assert_one_step_per_optimizer_step(res, num_steps=6, accum=2)
    assert_phases_add_up(res)
    assert_evaluation_kept_out(res, world_size=2)


def test_slow_dataset_is_input_bound(tmp_path: Path) -> None:
    res = run_script(tmp_path, SCRIPT, "--steps", "12", "--batch", str(BATCH),
                     "--input-sleep-ms", str(INPUT_SLEEP_MS_PER_STEP / BATCH))
    assert_one_step_per_optimizer_step(res, num_steps=12, accum=1)
    assert_input_bound(res)
