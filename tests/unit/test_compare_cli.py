"""`traceml compare A B`: inputs (files, session folders, bad JSON), outputs (BASE.json,
BASE.txt, stdout), exit codes (--fail-on) and the exact text of one fixed comparison."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_compare_verdict import GIB, summary, tight
from traceml.compare.cli import main
from traceml.report.model import SCHEMA_VERSION


def unboxed(card: str) -> str:
    """The card's text without its frame, wrapped lines joined by single spaces."""
    inner = (line.strip("|").strip() for line in card.splitlines() if line.startswith("|"))
    return " ".join(" ".join(inner).split())


def write(folder: Path, doc: Any) -> Path:
    """``folder/final_summary.json`` holding ``doc``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "final_summary.json").write_text(json.dumps(doc))
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """Session folders: a baseline, a 10 % slower run (slow input) and a faster one."""
    return {
        "base": write(tmp_path / "logs" / "base", summary(tight(100.0), session="base")),
        "slow": write(tmp_path / "logs" / "slow",
                      summary(tight(110.0), input_ms=15.0, session="slow")),
        "fast": write(tmp_path / "logs" / "fast", summary(tight(90.0), session="fast")),
    }


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# --- exit codes ---------------------------------------------------------------------


def test_regression_fails_only_with_fail_on(runs: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "cmp")
    assert main([str(runs["base"]), str(runs["slow"]), "--output", out]) == 0
    assert main([str(runs["base"]), str(runs["slow"]), "--output", out,
                 "--fail-on", "regression"]) == 1
    assert "Verdict: REGRESSION" in capsys.readouterr().out


@pytest.mark.parametrize(("b", "label"), [("fast", "IMPROVEMENT"), ("base", "NO CHANGE")])
def test_no_regression_passes_the_gate(runs: dict[str, Path], tmp_path: Path, b: str,
                                       label: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(runs["base"]), str(runs[b]), "--output", str(tmp_path / "c"), "--fail-on",
            "regression"]
    assert main(argv) == 0
    assert f"Verdict: {label}" in capsys.readouterr().out


def test_threshold_pct_is_configurable(runs: dict[str, Path], tmp_path: Path) -> None:
    argv = [str(runs["base"]), str(runs["slow"]), "--output", str(tmp_path / "c"),
            "--fail-on", "regression"]
    assert main([*argv, "--threshold-pct", "15"]) == 0
    assert main([*argv, "--threshold-pct", "5"]) == 1


# --- inputs and outputs --------------------------------------------------------------


def test_file_or_folder_writes_base_json_and_txt(runs: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "out" / "gate"
    assert main([str(runs["base"] / "final_summary.json"), str(runs["slow"]),
                 "--output", str(base)]) == 0
    out, err = capsys.readouterr()
    assert (tmp_path / "out" / "gate.txt").read_text() == out
    doc = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert (doc["verdict"], doc["a"]["label"], doc["b"]["label"]) == ("REGRESSION", "base", "slow")
    assert doc["step_time"]["phase"] == "input"
    assert doc["sections"]["step_time"]["metrics"][0] == {
        "key": "total_ms", "label": "Total step", "a": 100.0, "b": 110.0, "delta": 10.0,
        "delta_pct": 10.0}
    assert f"wrote {base}.json and {base}.txt" in err


def test_default_base_is_compare_a_vs_b_beside_run_b_never_the_current_folder(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    here = tmp_path / "repo"
    here.mkdir()
    monkeypatch.chdir(here)
    logs = runs["fast"].parent  # the folder that holds the session folders
    assert main([str(runs["base"]), str(runs["fast"]) + "/"]) == 0
    assert list(here.iterdir()) == []
    assert sorted(p.name for p in logs.glob("compare_*")) == [
        "compare_base_vs_fast.json", "compare_base_vs_fast.txt"]
    assert f"wrote {logs / 'compare_base_vs_fast'}.json" in capsys.readouterr().err
    # B given as its summary file: beside that file; a relative B resolves from here
    monkeypatch.chdir(logs)
    assert main(["base", "slow/final_summary.json"]) == 0
    assert sorted(p.name for p in (logs / "slow").glob("compare_*")) == [
        "compare_base_vs_slow.json", "compare_base_vs_slow.txt"]


def test_json_is_strict_and_names_every_section(runs: dict[str, Path], tmp_path: Path) -> None:
    main([str(runs["base"]), str(runs["fast"]), "--output", str(tmp_path / "c")])
    doc = json.loads((tmp_path / "c.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert list(doc) == ["compare_version", "verdict", "why", "threshold_pct", "a", "b", "notes",
                         "step_time", "memory", "sections", "captures"]
    assert list(doc["sections"]) == ["step_time", "step_memory", "process", "system",
                                     "throughput"]
    assert all(s["status"] == "compared" for s in doc["sections"].values())


def test_missing_section_is_stated_not_a_crash(runs: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    doc = summary(tight(100.0), session="b")
    del doc["step_time"]
    b = write(tmp_path / "b", doc)
    assert main([str(runs["base"]), str(b), "--output", str(tmp_path / "c"),
                 "--fail-on", "regression"]) == 0
    out = capsys.readouterr().out
    assert "Verdict: INCONCLUSIVE" in out
    assert "INCONCLUSIVE: Step Time missing in B." in out


def test_schema_minor_difference_is_stated(runs: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = summary(tight(100.0), session="b")
    doc["schema_version"] = "1.9"
    main([str(runs["base"]), str(write(tmp_path / "b", doc)), "--output", str(tmp_path / "c")])
    assert (f"Note: Summary schema versions differ (A {SCHEMA_VERSION}, B 1.9)"
            in capsys.readouterr().out)


def test_summary_not_matching_its_schema_is_stated(runs: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    doc = summary(tight(100.0), session="b")
    del doc["system"]
    main([str(runs["base"]), str(write(tmp_path / "b", doc)), "--output", str(tmp_path / "c")])
    out = unboxed(capsys.readouterr().out)
    assert (f"B does not fully match summary schema {SCHEMA_VERSION} (1 problems, first: $: "
            "missing key") in out


# --- bad input: exit 2, one line -------------------------------------------------------


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "is not valid JSON (line 1"),
    ("", "is not valid JSON"),
    ("[1, 2]", "is not a traceml final_summary.json (not a JSON object)"),
    ('{"foo": 1}', "is not a traceml final_summary.json (no schema_version or meta)"),
    ('{"schema_version": "2.0", "meta": {}}',
     "has summary schema 2.0, but this traceml reads schema 1.x"),
    ('{"schema_version": 1, "meta": {}}', "no schema_version or meta"),
])
def test_bad_json_is_one_line_exit_2(runs: dict[str, Path], tmp_path: Path, content: str,
                                     message: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    err = one_line_error(capsys, [str(runs["base"]), str(bad), "--output", str(tmp_path / "c")])
    assert err.startswith("traceml compare: B") and message in err, err
    assert not (tmp_path / "c.json").exists()


def test_binary_file_is_one_line_exit_2(runs: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    err = one_line_error(capsys, [str(bad), str(runs["base"])])
    assert err.startswith("traceml compare: A: cannot read")


def test_missing_path_and_empty_folder(tmp_path: Path, runs: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, [str(tmp_path / "nope"), str(runs["base"])])
    assert "A: " in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, [str(runs["base"]), str(tmp_path / "empty")])
    assert "has no final_summary.json" in err


@pytest.mark.parametrize("argv", [
    ["only-one"],
    ["a", "b", "--fail-on", "anything"],
    ["a", "b", "--threshold-pct", "-1"],
    ["a", "b", "--threshold-pct", "x"],
    ["a", "b", "--bogus"],
])
def test_bad_options_are_one_line_exit_2(argv: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, argv)
    assert err.startswith("traceml compare: ") and "--help" in err


def test_unwritable_output_is_one_line_exit_2(runs: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = one_line_error(capsys, [str(runs["base"]), str(runs["fast"]),
                                  "--output", str(blocker / "sub" / "c")])
    assert "cannot write" in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--output BASE", "--fail-on {regression}", "--threshold-pct PCT",
                   "compare_<A>_vs_<B>"):
        assert option in out


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else []
    for key, child in items:
        out += _paths(child, (*path, key))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mangled_summaries_never_crash(seed: int, runs: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Delete or retype random parts of a valid summary: exit 0 or 2, never a traceback."""
    rng = random.Random(seed)
    original = summary(tight(100.0), session="b")
    paths = _paths(original)
    for i in range(50):
        doc = json.loads(json.dumps(original))
        for _ in range(rng.randint(1, 4)):
            *parents, last = rng.choice(paths)
            node = doc
            for key in parents:  # an earlier mutation may have removed the way down
                found = isinstance(node, dict) and key in node or \
                    isinstance(node, list) and isinstance(key, int) and key < len(node)
                node = node[key] if found else None
            if isinstance(node, dict) and rng.random() < 0.3:
                node.pop(last, None)
            elif isinstance(node, dict) or isinstance(node, list) and last < len(node):
                node[last] = rng.choice([None, "x", [], {}, -1, True, 1e308, float("nan")])
        folder = write(tmp_path / f"m{i}", doc)
        code = main([str(runs["base"]), str(folder), "--output", str(tmp_path / "c")])
        out, err = capsys.readouterr()
        assert code in (0, 2), err
        if code == 2:
            assert err.count("\n") == 1, err
        else:
            assert out.startswith("+---") and "Verdict: " in out


# --- the exact text ---------------------------------------------------------------------

EXPECTED_TEXT = """\
+------------------------------------------------------------------------------+
|  TraceML Compare                                                             |
+------------------------------------------------------------------------------+
|                                                                              |
|  Verdict: MIXED                                                              |
|  Why: Step time rose 10.0% (100.0 -> 110.0 ms per step), beyond the 5%       |
|    threshold and the runs' step-to-step noise (0.5 ms); most of it is input  |
|    time (+10.0 ms) but peak host RSS fell 50.0% (2.0 GiB -> 1.0 GiB).        |
|                                                                              |
|  A: base (1 rank, cpu)                                                       |
|  B: slow (2 ranks, cpu, session slow-2)                                      |
|  Delta: B - A (values: median over ranks of each rank's mean or peak)        |
|  Note: World sizes differ (A 1 rank, B 2 ranks); values are medians over     |
|    ranks.                                                                    |
|                                                                              |
|  Step Time                                                                   |
|  Diagnosis: A COMPUTE-BOUND, B INPUT-BOUND (changed)                         |
|  Metric              A         B         Delta     %                         |
|  Total step          100.0 ms  110.0 ms  +10.0 ms  +10.0%                    |
|  Input               5.0 ms    15.0 ms   +10.0 ms  +200.0%                   |
|  Forward             28.5 ms   28.5 ms   +0.0 ms   +0.0%                     |
|  Backward            57.0 ms   57.0 ms   +0.0 ms   +0.0%                     |
|  Optimizer           9.5 ms    9.5 ms    +0.0 ms   +0.0%                     |
|  Wait                0.0 ms    0.0 ms    +0.0 ms   -                         |
|  Compute             95.0 ms   95.0 ms   +0.0 ms   +0.0%                     |
|  Median step (p50)   100.0 ms  110.0 ms  +10.0 ms  +10.0%                    |
|  Step spread (IQR)   1.0 ms    1.0 ms    +0.0 ms   +0.0%                     |
|                                                                              |
|  Step Memory                                                                 |
|  Diagnosis: BALANCED in both (same)                                          |
|  Metric              A         B         Delta     %                         |
|  Host RSS peak       2.0 GiB   1.0 GiB   -1.0 GiB  -50.0%                    |
|  Host RSS growth     0 B       0 B       +0 B      -                         |
|                                                                              |
|  Process                                                                     |
|  Diagnosis: NORMAL in both (same)                                            |
|  Metric              A         B         Delta     %                         |
|  CPU avg             90.0%     90.0%     +0.0 pp   +0.0%                     |
|  CPU share of cores  11.2%     22.5%     +11.2 pp  +100.0%                   |
|  RSS peak            2.0 GiB   1.0 GiB   -1.0 GiB  -50.0%                    |
|  RSS of host RAM     3.1%      1.6%      -1.6 pp   -50.0%                    |
|                                                                              |
|  System                                                                      |
|  Diagnosis: NORMAL in both (same)                                            |
|  Metric              A         B         Delta     %                         |
|  Host CPU avg        40.0%     40.0%     +0.0 pp   +0.0%                     |
|  Host RAM peak       30.0%     30.0%     +0.0 pp   +0.0%                     |
|                                                                              |
|  Throughput                                                                  |
|  Diagnosis: THROUGHPUT in both (same)                                        |
|  Metric              A         B         Delta     %                         |
|  Samples per step    32        32        +0        +0.0%                     |
|  Samples/s           320       290.9     -29.09    -9.1%                     |
+------------------------------------------------------------------------------+
"""


def test_exact_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "base", summary(tight(100.0), session="base", rss_bytes=2 * GIB))
    b = write(tmp_path / "slow", summary(tight(110.0), input_ms=15.0, world=2,
                                         session="slow-2"))
    assert main([str(a), str(b), "--output", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out == EXPECTED_TEXT


@pytest.mark.parametrize("kind", ["deep", "zero", "fifo", "huge"])
def test_files_that_are_no_summary_are_one_line(runs: dict[str, Path], tmp_path: Path,
                                                kind: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import os

    import traceml.compare.load as load

    path = tmp_path / "side.json"
    if kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # nobody writes: reading it would wait forever
    else:
        monkeypatch.setattr(load, "MAX_SUMMARY_BYTES", 1000)  # the real cap is 256 MiB
        path.write_bytes(b" " * 1001)
    assert main([str(path), str(runs["base"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("traceml compare: A:"), err


def test_the_card_fits_80_columns_with_the_longest_labels_and_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The longest diagnosis labels, four-digit milliseconds and large rates: a narrower
    # layout (diagnoses on their own line, a rate's unit in its name), never "...".
    docs = []
    for name, label, scale in (("a", "BORDERLINE COMMUNICATION-BOUND", 1.0),
                               ("b", "HOST-WORK STRAGGLER", 1.3)):
        doc = summary(tight(4321.0 * scale), session=name, rss_bytes=900 * GIB)
        for section in ("step_time", "step_memory", "process", "system"):
            doc[section]["diagnosis"]["label"] = label
        docs.append(write(tmp_path / name, doc))
    assert main([str(docs[0]), str(docs[1]), "--output", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) == 80, out
    assert "..." not in out and "…" not in out
    assert ("Diagnosis: A BORDERLINE COMMUNICATION-BOUND, B HOST-WORK STRAGGLER (changed)"
            in unboxed(out))
    assert "4321.0 ms" in out and "5617.3 ms" in out


def test_rates_read_whole_without_exponents() -> None:
    from traceml.compare.text import format_delta, format_value
    assert format_value("tokens_per_s", 123456.0) == "123,456"
    assert format_delta("tokens_per_s", -12345.4) == "-12,345"
    assert format_value("samples_per_s", 290.91) == "290.9"
    assert format_value("achieved_tflops", 4.062e-05) == "4.062e-05"
    assert format_delta("samples_per_s", 750.44) == "+750.4"


def test_default_base_beside_a_symlinked_session_stays_in_the_logs_folder(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "archive" / "fast-2026"
    elsewhere.parent.mkdir()
    runs["fast"].rename(elsewhere)
    (runs["base"].parent / "latest").symlink_to(elsewhere)
    monkeypatch.chdir(tmp_path)
    assert main([str(runs["base"]), "logs/latest"]) == 0
    assert sorted(p.name for p in (tmp_path / "logs").glob("compare_*")) == [
        "compare_base_vs_fast-2026.json", "compare_base_vs_fast-2026.txt"]  # its label
    assert not list((tmp_path / "archive").glob("compare_*"))


def test_a_crafted_summary_cannot_send_escape_sequences_to_the_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Strings of a summary reach the card (session, labels, why): their control
    characters are written out, never sent as they are."""
    doc = summary(tight(110.0), input_ms=15.0, session="evil\x1b]0;owned\x07\x1b[2J")
    doc["step_time"]["diagnosis"]["label"] = "INPUT\x1b[31m-BOUND\r\u202e"
    evil = write(tmp_path / "logs" / "evil", doc)
    base = write(tmp_path / "logs" / "base", summary(tight(100.0), session="base"))
    assert main([str(base), str(evil), "--output", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert not any(ch in out for ch in "\x1b\x07\r\u202e")
    assert "evil\\x1b]0;owned\\x07\\x1b[2J" in out
    written = (tmp_path / "c.txt").read_text()
    assert "\x1b" not in written and "INPUT\\x1b[31m-BOUND\\x0d\\u202e" in unboxed(written)


def capture_doc(capture_id: str, mm_ms: float, shapes: str) -> dict[str, Any]:
    """A summary's capture (schema 1.6) whose suspect spent ``mm_ms`` in aten::mm."""
    def op(name: str, ms: float, shape: str, collective: bool = False) -> dict[str, Any]:
        return {"name": name, "communication": collective, "diff_ms": None,
                "suspect": {"ms": ms, "calls": 3.0, "shapes": shape}, "reference": None}
    return {"id": capture_id, "trigger": "COMPUTE_STRAGGLER", "label": "COMPUTE STRAGGLER r1",
            "phase": "compute", "suspect": 1, "reference": None, "first_step": 40,
            "steps_asked": 2, "num_steps": 2, "device": False,
            "phase_ms": {"suspect": None, "reference": None}, "compute_diff_ms": None,
            "communication_diff_ms": None, "traces": [], "notes": [],
            "operators": [op("aten::mm", mm_ms, shapes), op("aten::relu", 1.0, "[8, 8]"),
                          op("gloo:all_reduce", 9.0, "", True)]}


def test_a_regression_s_capture_is_set_against_the_baseline_s(tmp_path: Path) -> None:
    base = summary(tight(100.0), session="base")
    slow = summary(tight(120.0), session="slow")
    base["captures"] = [capture_doc("c1-compute_straggler", 10.0, "[64, 512], [512, 512]")]
    slow["captures"] = [capture_doc("c1-compute_straggler", 24.0, "[128, 512], [512, 512]")]
    a, b = write(tmp_path / "base", base), write(tmp_path / "slow", slow)
    main([str(a), str(b), "--output", str(tmp_path / "cmp")])
    doc = json.loads((tmp_path / "cmp.json").read_text())
    top = doc["captures"]["operators"][0]
    assert (top["name"], top["a_ms"], top["b_ms"], top["delta_ms"]) == ("aten::mm", 10.0, 24.0,
                                                                        14.0)
    assert doc["captures"]["operators"][-1]["name"] == "gloo:all_reduce"  # collectives last
    text = unboxed((tmp_path / "cmp.txt").read_text())
    assert ("aten::mm +14.00 ms (A 10.00, B 24.00); A [64, 512], [512, 512]; "
            "B [128, 512], [512, 512]") in text
    base.pop("captures")
    write(tmp_path / "base", base)  # a summary from before captures: nothing to set against
    main([str(a), str(b), "--output", str(tmp_path / "cmp")])
    assert json.loads((tmp_path / "cmp.json").read_text())["captures"] is None
