"""A plain loop driven by Hugging Face Accelerate under ``traceml run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks.expectations import (
    assert_evaluation_kept_out,
    assert_one_step_per_optimizer_step,
    check_ddp_two_ranks,
    check_slow_dataset_is_input_bound,
    check_steps_with_evaluation,
    eval_args,
    run_script,
)

pytest.importorskip("accelerate")

pytestmark = pytest.mark.frameworks
SCRIPT = "accelerate_loop.py"
BATCH = 8


@pytest.mark.parametrize("accum", [1, 4])
def test_loop_steps_with_evaluation(tmp_path: Path, accum: int) -> None:
    check_steps_with_evaluation(tmp_path, SCRIPT, BATCH, accum)


def test_plain_evaluation_loader_stays_out(tmp_path: Path) -> None:
    # Accelerate's prepared loaders fetch one batch ahead, a plain DataLoader does not:
    # its last fetch (StopIteration) comes after the last evaluation forward.
    res = run_script(tmp_path, SCRIPT, *eval_args(9, 1, BATCH), "--raw-eval-loader")
    assert_one_step_per_optimizer_step(res, num_steps=9, accum=1)
    assert_evaluation_kept_out(res)


def test_ddp_two_ranks(tmp_path: Path) -> None:
    check_ddp_two_ranks(tmp_path, SCRIPT, BATCH)


def test_slow_dataset_is_input_bound(tmp_path: Path) -> None:
    check_slow_dataset_is_input_bound(tmp_path, SCRIPT, BATCH)
