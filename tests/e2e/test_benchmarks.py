"""Every script in scripts/ that measures still runs on this code, to its last line:
each one's ``--quick`` mode (a small run; its figures are not the README's).  A
benchmark broken here would otherwise be found broken by its next reader.  And a
benchmark fails instead of hanging: a sender process's error, a sender that dies
or never answers, and the whole run's time limit each end it with exit 1."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from tests.conftest import ROOT

SCRIPTS = ROOT / "scripts"

# script, its options beside --quick ("{tmp}": the test's folder), whether a miss
# of an accuracy case may end it (exit 1 after its tally), lines its output must hold
STORED_ALL = r"^\s*64 ranks .* stored (\d+)/\1 .* dropped: senders 0, collector 0 gaps"
QUICK: list[tuple[str, list[str], bool, list[str]]] = [
    ("bench_collector_scale.py", ["--scrape", "on"], False,
     [STORED_ALL, r"^\s+relay: 8 nodes of 8 ranks",
      r"^\s+/metrics scraped 1/s: [1-9]\d* answers, 0 failed"]),
    ("bench_collector_scale.py", ["--mode", "direct"], False,
     [STORED_ALL, r"^\s+direct: 64 ranks send to the collector"]),
    ("bench_overhead.py", [], False,
     [r"^short step paired added cpu .* µs/step", r"^long step\s+A/A ",
      r"^steps the collector made of the events: [1-9]\d*, messages sent \d+, dropped 0$",
      r"^start-up\s+torchrun [\d.]+ s\s+traceml run [\d.]+ s"]),
    ("bench_overhead.py", ["--metrics", "--capture", "--startup-runs", "0"], False,
     [r"^torch .* collector live on port \d+, with Prometheus /metrics scraped 1/s, "
      r"captures on \(none run\)$",
      r"^short step paired added cpu .* µs/step", r"^/metrics scrapes answered: [1-9]\d*$"]),
    ("bench_overhead.py", ["--split"], False,
     [r"^split backward .* added\s+-?[\d.]+ µs a call",
      r"^split whole step .* the parts above add up to -?[\d.]+ µs$"]),
    ("bench_overhead.py", ["--ddp"], False,
     [r"^ddp comm\s+cpu paired added .* µs/bucket, \d+ buckets",
      r"^ddp in flight\s+cpu added .* µs/backward"]),
    ("bench_ray_overhead.py", ["--time-limit", "220"], False,
     [r"^ray fit 2: traced in \d+ s", r"^traceml run 2: traced in \d+ s",
      r"^-- Ray Train: traceml.integrations.ray.fit against trainer.fit\(\)\n"
      r"short  wall  untraced +[\d.]+ ms/step  paired added +-?[\d.]+ µs/step",
      r"^-- the same loops as 2 ranks of traceml run, against --no-trace\n"
      r"short  wall  untraced"]),
    ("bench_page_scale.py", [], False,
     [r"^\s+64\s+10\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+\d+\s+\d+\s+[\d.]+$"]),
    ("bench_summary_scale.py", ["--cache", "{tmp}"], False,
     [r"^\s+8x2000\s+16,000 .* bounded .*STRAGGLER", r"^\s+8x2000\s+16,000 .* full ",
      r"^\s+64x50\s+3,200 .* bounded "]),
    ("bench_compare_noise.py", ["--logs-dir", "{tmp}"], False,
     [r"^identical runs: \d/2 ordered pairs said NO CHANGE",
      r"^input \+15%: \d/4 \(baseline, slowed\) pairs said REGRESSION"]),
    ("bench_creep_accuracy.py", [], True,
     [r"^  creep  \d/1 found HOST RSS CREEP", r"^  flat   \d/1 found HOST RSS CREEP"]),
    ("bench_stall_accuracy.py", [], True, [r"^raise\s+\d/1"]),
    ("bench_capture_accuracy.py", [], True,
     [r"^  uneven\s+\d/1 hit", r"^captured steps: median [\d.]+x the run's typical step"]),
    ("bench_throughput_accuracy.py", [], True, [r"^  noloader\s+\d/1 hit \| largest rate error"]),
    ("bench_straggler_accuracy.py", [], True,
     [r"^  backward\s+\d/1 hit", r"^  hook\s+\d/1 hit \| \d+% \([\d.]+ ms off\)"]),
    ("fuzz_collector.py", [], False,
     [r"^PASS  launcher exit status 0$", r"^PASS  summary written and schema-valid$",
      r"^PASS  real ranks' step counts exact$"]),
    ("check_demo.py", [], True, [r"^run 1: \S", r"^\d/1 as expected$"]),
]


def run_script(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize(("name", "options", "may_miss", "lines"), QUICK,
                         ids=[" ".join([name, *options]).replace("{tmp}", "tmp")
                              for name, options, _, _ in QUICK])
def test_quick_mode_runs_to_its_last_line(tmp_path: Path, name: str, options: list[str],
                                          may_miss: bool, lines: list[str]) -> None:
    done = run_script(name, "--quick", *(o.replace("{tmp}", str(tmp_path)) for o in options))
    said = f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # an accuracy case may miss on a loaded machine (its tally says so, exit 1); the
    # script itself may not fail
    assert done.returncode == 0 or (may_miss and done.returncode == 1
                                    and "Traceback" not in done.stderr
                                    and "failed" not in done.stderr), said
    for line in lines:
        assert re.search(line, done.stdout, re.MULTILINE), (line, said)


@pytest.mark.parametrize("command", [
    ["bench_collector_scale.py", "--quick", "--duration", "60", "--time-limit", "3"],
    # demo.sh's traceml run (launcher, collector, ranks) under the script: all of it goes
    ["check_demo.py", "--quick", "--time-limit", "5"],
], ids=["collector-scale", "traceml-run-below-a-shell"])
def test_time_limit_stops_a_benchmark_and_leaves_nothing_behind(command: list[str]) -> None:
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / command[0]), *command[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=ROOT)
    seen: dict[int, float] = {}  # every process it started, ranks in their own sessions too
    try:
        while proc.poll() is None and time.monotonic() - started < 60:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        seen.setdefault(child.pid, child.create_time())
            time.sleep(0.05)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, (out, err)
    assert f"still running after {command[-1]} s (--time-limit); stopped" in err, err
    assert time.monotonic() - started < 30
    assert seen, "it started no process"
    deadline = time.monotonic() + 3  # killed at once, not left to finish on their own
    while _alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(seen) == []


def _alive(seen: dict[int, float]) -> list[int]:
    """Those of ``seen`` (pid: start time) still running, zombies aside."""
    alive = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module("bench_collector_scale")
    finally:
        sys.path.remove(str(SCRIPTS))


def test_a_sender_process_that_fails_ends_the_benchmark_with_its_error(
        scale: ModuleType) -> None:
    out: mp.Queue[object] = mp.Queue()
    broken = mp.Process(target=scale.simulate, args=(
        "tcp://127.0.0.1:9", None, [("rank", ("not a rank",))], time.time(), 1.0, out))
    broken.start()
    with pytest.raises(SystemExit, match=r"(?s)a simulating process failed:.*TypeError"):
        scale.gather([broken], out, deadline=time.time() + 60)
    broken.join(10)


def test_a_sender_that_dies_or_never_answers_ends_the_benchmark(scale: ModuleType) -> None:
    out: mp.Queue[object] = mp.Queue()
    died = mp.Process(target=os._exit, args=(3,))
    died.start()
    with pytest.raises(SystemExit, match=r"died \(exit 3\)"):
        scale.gather([died], out, deadline=time.time() + 60)
    silent = mp.Process(target=time.sleep, args=(30,), daemon=True)
    silent.start()
    started = time.monotonic()
    with pytest.raises(SystemExit, match="1 simulating processes never reported"):
        scale.gather([silent], out, deadline=time.time() + 1)
    assert time.monotonic() - started < 10
    silent.kill()
