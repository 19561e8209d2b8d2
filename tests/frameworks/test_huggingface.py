"""transformers.Trainer under ``traceml run``: zero-code and with TraceMLCallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks.expectations import (
    check_ddp_two_ranks,
    check_slow_dataset_is_input_bound,
    check_steps_with_evaluation,
)

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.frameworks
SCRIPT = "hf_trainer.py"
BATCH = 4


@pytest.mark.parametrize(("accum", "callback"), [(1, False), (2, False), (2, True)],
                         ids=["zero-code", "zero-code-accum", "callback-accum"])
def test_trainer_steps_with_evaluation(tmp_path: Path, accum: int, callback: bool) -> None:
    check_steps_with_evaluation(tmp_path, SCRIPT, BATCH, accum, callback)


def test_ddp_two_ranks(tmp_path: Path) -> None:
    check_ddp_two_ranks(tmp_path, SCRIPT, BATCH)


def test_slow_dataset_is_input_bound(tmp_path: Path) -> None:
    check_slow_dataset_is_input_bound(tmp_path, SCRIPT, BATCH)
