"""Guards: import cost, import direction, the pinned CLI option set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import traceml

PKG = Path(traceml.__file__).parent


def test_import_traceml_is_cheap() -> None:
    code = ("import sys, traceml; heavy = [m for m in ('torch', 'zmq', 'rich', 'tabulate') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_agent_imports_only_the_standard_library_torch_zmq_and_orjson() -> None:
    """Outside the project (the import contracts cover inside it): a guest in every rank
    brings no other dependency."""
    import ast

    allowed = {"torch", "zmq", "orjson", "traceml"}
    for path in (PKG / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                assert top in allowed or top in sys.stdlib_module_names, (path, name)


# What a training rank must never pay for (the import contracts in pyproject.toml check the
# sources; this checks what actually gets loaded, imports made at run time included).
AGENT_NEVER_LOADS = ("rich", "tabulate", "traceml.report", "traceml.diagnosis",
                     "traceml.collector", "traceml.live", "traceml.compare", "traceml.launcher",
                     "traceml.store")


def _loaded_by_importing(package: str) -> set[str]:
    """Every module in sys.modules after a fresh interpreter imports every module
    of ``package``."""
    code = (f"import json, pkgutil, sys, {package}\n"
            f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
            "    __import__(m.name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_importing_the_agent_loads_no_analysis_or_rendering_code() -> None:
    loaded = _loaded_by_importing("traceml.agent")
    assert {"traceml.agent.activate", "traceml.agent.patches", "traceml.agent.runtime",
            "torch", "zmq"} <= loaded
    assert sorted(m for m in loaded for banned in AGENT_NEVER_LOADS
                  if m == banned or m.startswith(banned + ".")) == []


def test_importing_the_report_loads_no_live_view() -> None:
    # The live views draw the report's page model (traceml.report.page), never the reverse;
    # the layers contract checks the sources, this what gets loaded at run time.
    loaded = _loaded_by_importing("traceml.report")
    assert {"traceml.report.html", "traceml.report.page.render", "traceml.report.page.snapshot"} <= loaded
    assert sorted(m for m in loaded if m == "traceml.live" or m.startswith("traceml.live.")) == []


def test_site_dir_holds_only_sitecustomize() -> None:
    files = [p.name for p in (PKG / "agent" / "site_dir").iterdir() if p.name != "__pycache__"]
    assert files == ["sitecustomize.py"]


# Every traceml option, pinned: renaming one breaks users' scripts.
TRACEML_OPTIONS = {
    "--mode", "--logs-dir", "--logs_dir", "--session-id", "--session_id", "--aggregator-host",
    "--aggregator_host", "--aggregator-port", "--aggregator_port", "--aggregator-bind-host",
    "--aggregator_bind_host", "--summary-window-rows", "--summary_window_rows",
    "--sample-interval", "--sample_interval", "--stall-timeout", "--stall_timeout",
    "--dashboard-port", "--dashboard_port", "--html",
    "--no-trace", "--no_trace", "--no-flops", "--no_flops", "--peak-tflops", "--peak_tflops",
    "--metrics-port", "--metrics_port", "--metrics-bind-host", "--metrics_bind_host",
    "--otlp-endpoint", "--otlp_endpoint", "--otlp-interval", "--otlp_interval",
    "--capture", "--capture-steps", "--capture_steps", "--capture-max-mb", "--capture_max_mb",
}


def test_run_accepts_every_torchrun_option_plus_ours() -> None:
    from torch.distributed import run as torchrun

    from traceml.launcher.args import build_parser

    theirs = {s for a in torchrun.get_args_parser()._actions for s in a.option_strings}
    ours = {s for a in build_parser("traceml run")._actions for s in a.option_strings}
    assert theirs <= ours
    assert ours - theirs == TRACEML_OPTIONS


def test_torchrun_spellings_and_env_fallbacks_parse() -> None:
    import os

    from traceml.launcher.args import parse

    cfg = parse("run", ["--nproc_per_node=2", "--max-restarts", "1", "--standalone",
                        "--mode", "cli", "-m", "pkg.train", "--lr", "3"])
    assert cfg.torch_args.nproc_per_node == "2" and cfg.torch_args.max_restarts == 1
    assert cfg.module and cfg.training_script == "pkg.train"
    assert cfg.training_script_args == ("--lr", "3") and cfg.mode == "cli"
    assert not hasattr(cfg.torch_args, "mode")
    os.environ["PET_NPROC_PER_NODE"] = "3"
    try:
        assert parse("run", ["x.py"]).torch_args.nproc_per_node == "3"
    finally:
        del os.environ["PET_NPROC_PER_NODE"]


def test_worker_output_redirection_is_decided_at_parse_and_copies_torchs_namespace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml.launcher.args import parse, torch_namespace

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cfg = parse("run", ["--mode", "cli", "--logs-dir", "/l", "--session-id", "s", "x.py"])
    assert cfg.worker_log_dir == "/l/s/workers"
    launched = torch_namespace(cfg, redirect_output=True)
    assert (launched.log_dir, launched.redirects, launched.tee) == ("/l/s/workers", "3", "0")
    assert (cfg.torch_args.log_dir, cfg.torch_args.redirects) == (None, "0")  # untouched
    plain = torch_namespace(cfg, redirect_output=False)
    assert vars(plain) == vars(cfg.torch_args) and plain is not cfg.torch_args
    given = parse("run", ["--mode", "cli", "--log-dir", "/w", "x.py"])
    assert given.worker_log_dir == "/w" and given.torch.nproc_per_node == "1"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert parse("run", ["--mode", "cli", "x.py"]).worker_log_dir is None
