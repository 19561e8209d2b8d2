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


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "abc", ""])
def test_one_stall_timeout_parser_for_the_option_and_the_environment(text: str) -> None:
    """--stall-timeout and TRACEML_STALL_TIMEOUT (what the agent reads) refuse alike."""
    from traceml.environment import AgentEnv, parse_stall_timeout
    from traceml.errors import UsageError

    with pytest.raises(UsageError, match=f"must be auto, 0 \\(off\\) or seconds > 0, got {text}"):
        parse("run", ["--stall-timeout", text, "train.py"])
    with pytest.raises(ValueError, match="must be auto"):
        parse_stall_timeout(text)
    env = dict(AgentEnv(session_id="s", endpoint="tcp://127.0.0.1:1", launcher_pid=1,
                        sample_interval_s=1.0, session_dir="/tmp").to_env())
    env["TRACEML_STALL_TIMEOUT"] = text
    with pytest.raises(ValueError, match="must be auto"):
        AgentEnv.from_env(env)


def test_stall_timeouts_that_parse() -> None:
    from traceml.environment import parse_stall_timeout

    assert [parse_stall_timeout(t) for t in ("auto", "0", "30", "2.5")] == [None, 0.0, 30.0, 2.5]
    assert parse("run", ["--stall-timeout", "45", "train.py"]).stall_timeout_s == 45.0


def test_an_unexpected_error_in_the_stall_alerts_is_said_once_and_ends_them(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from traceml.launcher.health import StallAlert

    alert = StallAlert(Path(str(tmp_path)) / "telemetry.sqlite")
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("a bug")
    alert.check = broken  # type: ignore[method-assign]
    assert alert._guarded_check() is False
    assert alert._guarded_check() is False  # not tried again
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert err.count("live stall alerts stopped (RuntimeError('a bug'))") == 1
