"""``traceml run`` options given after the script: found at parse time (every
spelling of traceml's and torchrun's options), named at the end only when the
script refused its arguments as argparse does (exit 2)."""

from __future__ import annotations

import dataclasses

import pytest

from traceml.launcher.args import parse
from traceml.launcher.launch import late_options_hint


@pytest.mark.parametrize(("argv", "late"), [
    (["--html", "train.py", "--lr", "1"], ()),
    (["train.py", "--html"], ("--html",)),
    (["train.py", "--nproc-per-node=2", "--nproc_per_node", "2", "--lr", "1"],
     ("--nproc-per-node", "--nproc_per_node")),
    (["train.py", "--mode", "cli", "--stall-timeout=5", "-x", "--steps", "3"],
     ("--mode", "--stall-timeout")),
    (["train.py", "html", "--", "--htmlx"], ()),
])
def test_late_options_are_the_scripts_arguments_that_are_ours(argv: list[str],
                                                              late: tuple[str, ...]) -> None:
    cfg = parse("run", argv)
    assert cfg.late_options == late
    assert cfg.training_script == "train.py"


def test_the_hint_needs_a_usage_exit_and_a_late_option() -> None:
    late = parse("run", ["train.py", "--html"])
    assert late_options_hint(late, 2) == (
        "traceml run: train.py exited 2 (argparse's status for arguments it does not take) "
        "and got --html, an option of traceml run too; if it was meant for traceml or "
        "torchrun, put it before the script: traceml run [options] train.py "
        "[script arguments]")
    assert late_options_hint(late, 0) is None  # the script took --html as its own
    assert late_options_hint(late, 1) is None  # it failed for some other reason
    assert late_options_hint(dataclasses.replace(late, late_options=()), 2) is None
