"""transformers.Trainer under ``traceml run``: zero-code and with TraceMLCallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks.expectations import (
    INPUT_SLEEP_MS_PER_STEP,
    assert_evaluation_kept_out,
    assert_input_bound,
    assert_one_step_per_optimizer_step,
    assert_phases_add_up,
    assert_steps_end_at_the_callback,
    callback_args,
    eval_args,
    run_script,
)

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.frameworks
SCRIPT = "hf_trainer.py"
BATCH = 4


@pytest.mark.parametrize(("accum", "callback"), [(1, False), (2, False), (2, True)],
                         ids=["zero-code", "zero-code-accum", "callback-accum"])
def test_trainer_steps_with_evaluation(tmp_path: Path, accum: int, callback: bool) -> None:
    res = run_script(tmp_path, SCRIPT, *eval_args(9, accum, BATCH),
                     *(callback_args() if callback else []))
    assert_one_step_per_optimizer_step(res, num_steps=9, accum=accum)
    assert_phases_add_up(res)
    assert_evaluation_kept_out(res)
    if callback:
        assert_steps_end_at_the_callback(res)


def test_ddp_two_ranks(tmp_path: Path) -> None:
    res = run_script(tmp_path, SCRIPT, *eval_args(6, 2, BATCH), nproc=2)
    assert_one_step_per_optimizer_step(res, num_steps=6, accum=2)
    assert_phases_add_up(res)
    assert_evaluation_kept_out(res, world_size=2)


def test_slow_dataset_is_input_bound(tmp_path: Path) -> None:
    res = run_script(tmp_path, SCRIPT, "--steps", "12", "--batch", str(BATCH),
                     "--input-sleep-ms", str(INPUT_SLEEP_MS_PER_STEP / BATCH))
    assert_one_step_per_optimizer_step(res, num_steps=12, accum=1)
    assert_input_bound(res)
