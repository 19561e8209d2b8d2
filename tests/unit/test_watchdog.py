"""The agent's stall watch, stack parsing and phase placement (traceml.agent.watchdog,
traceml.stacks), with a fake clock and real frames and faulthandler output."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from traceml import phases, stacks
from traceml.agent.watchdog import (
    AUTO_FLOOR_S,
    AUTO_WARMUP_S,
    StallWatch,
    out_of_memory_detail,
)
from traceml.errors import ProtocolError
from traceml.stacks import Frame
from traceml.wire.events import BACKWARD, FORWARD, NUM_EVENT_CODES, OPTIMIZER_END
from traceml.wire.incidents import RESUMED, STALL, IncidentReport

WALL = 1_700_000_000.0


def events(**by_code: list[float]) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in range(NUM_EVENT_CODES)]
    codes = {"forward": FORWARD, "backward": BACKWARD, "opt_end": OPTIMIZER_END}
    for name, ts in by_code.items():
        times[codes[name]] = ts
    return times


def watch(timeout_s: float | None, frames: dict[int, Any] | None = None) -> StallWatch:
    return StallWatch(timeout_s, 7, WALL, lambda: frames or {})


def test_no_events_past_the_threshold_is_one_stall_with_the_training_threads_stack() -> None:
    frame = sys._getframe()
    w = watch(3.0, {7: frame})
    assert w.observe(events(forward=[10.0]), 10.1) == []
    assert w.observe(events(), 12.9) == []  # not yet past the threshold
    (report,) = w.observe(events(), 13.2)
    assert report.what == STALL and report.began_at == WALL + 10.0 and report.at == WALL + 13.2
    assert report.stack[-1].function == "test_no_events_past_the_threshold_is_one_stall_with" \
        "_the_training_threads_stack"
    assert w.observe(events(), 20.0) == []  # reported once
    (resumed,) = w.observe(events(backward=[25.0]), 25.1)  # a phase begins again
    assert (resumed.what, resumed.began_at, resumed.at) == (RESUMED, WALL + 10.0, WALL + 25.0)


def test_a_stall_is_not_resumed_by_the_unwinding_of_an_interrupt_nor_at_exit() -> None:
    w = watch(3.0)
    w.observe(events(forward=[10.0]), 10.1)
    assert [r.what for r in w.observe(events(), 14.0)] == [STALL]
    ends_only = events()
    ends_only[phases.code("communication") + len(phases.PHASES)] = [15.0]  # an END code
    assert w.observe(ends_only, 15.1) == []
    assert w.observe(events(forward=[16.0]), 16.1, final=True) == []


def test_a_gap_seen_afterwards_is_reported_as_a_stall_that_ended() -> None:
    # This thread could not run during the gap (a C call held the GIL): the events
    # of both sides arrive in one take.
    w = watch(3.0)
    w.observe(events(forward=[10.0]), 10.1)
    (report,) = w.observe(events(backward=[10.2], forward=[19.0]), 19.1)
    assert (report.what, report.began_at, report.at) == (RESUMED, WALL + 10.2, WALL + 19.0)


def test_a_stack_inside_torch_compile_is_busy_not_stalled() -> None:
    compiling = SimpleNamespace(f_code=SimpleNamespace(
        co_filename="/venv/site-packages/torch/_inductor/compile_fx.py", co_name="compile"),
        f_lineno=1, f_back=None)
    frames: dict[int, Any] = {7: compiling}
    w = watch(3.0, frames)
    w.observe(events(forward=[10.0]), 10.1)
    assert w.observe(events(), 14.0) == []
    # Looked at again half a threshold later: still compiling, still busy...
    assert w.observe(events(), 15.6) == []
    frames[7] = sys._getframe()  # ...then the compiler is done and nothing moves: a stall
    assert w.observe(events(), 16.0) == []  # not before its next look
    (report,) = w.observe(events(), 17.2)
    assert (report.what, report.began_at) == (STALL, WALL + 10.0)


def test_the_automatic_threshold_follows_the_median_step() -> None:
    w = watch(None)
    assert w.threshold_s() == AUTO_WARMUP_S  # before 5 steps
    w.observe(events(opt_end=[0.1 * i for i in range(1, 21)]), 2.1)
    assert w.threshold_s() == AUTO_FLOOR_S  # 20 x 0.1 s is under the floor
    w.observe(events(opt_end=[2.0 + 10.0 * i for i in range(1, 40)]), 400.0)
    assert w.threshold_s() == 200.0  # 20 x the median 10 s step
    assert watch(0).observe(events(forward=[1.0]), 1.0) == [] and not watch(0).enabled


def test_reports_survive_the_wire_and_bad_ones_are_refused() -> None:
    w = watch(1.0, {7: sys._getframe()})
    w.observe(events(forward=[1.0]), 1.0)
    (report,) = w.observe(events(), 2.5)
    assert IncidentReport.from_payload(report.payload()) == report
    for bad in ({"what": "nap", "began_at": 1.0, "at": 2.0},
                {"what": STALL, "began_at": float("nan"), "at": 2.0},
                {"what": STALL, "began_at": 1.0, "at": 2.0, "stack": [["f", "x", "g"]]},
                {"what": STALL, "began_at": 1.0, "at": 2.0, "detail": {"k": [1]}}):
        with pytest.raises(ProtocolError):
            IncidentReport.from_payload(bad)


def test_faulthandler_output_is_parsed_for_the_main_thread() -> None:
    code = ("import faulthandler, sys, threading\n"
            "def inner():\n    faulthandler.dump_traceback(sys.stdout, all_threads=True)\n"
            "def outer():\n    inner()\n"
            "t = threading.Thread(target=lambda: threading.Event().wait(5), daemon=True)\n"
            "t.start()\nprint(threading.main_thread().ident)\nsys.stdout.flush()\nouter()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30).stdout
    ident, text = out.split("\n", 1)
    frames = stacks.parse_faulthandler(text, int(ident))
    assert [f.function for f in frames] == ["<module>", "outer", "inner"]
    assert frames[-1].line == 3 and not frames[-1].user  # "<string>" is no file of the user's
    other = stacks.parse_faulthandler(text, None)  # no id: the current thread's
    assert other == frames


def test_the_phase_of_a_stack_is_its_innermost_marker() -> None:
    site = "/venv/lib/python3.11/site-packages/"
    module = Frame(site + "torch/nn/modules/module.py", 1, "_call_impl")
    optim = Frame(site + "torch/optim/optimizer.py", 1, "wrapper")
    c10d = Frame(site + "torch/distributed/distributed_c10d.py", 1, "all_reduce")
    user = Frame("/home/me/train.py", 9, "main")
    assert stacks.phase_of([user]) is None
    assert stacks.phase_of([user, optim, user, module, user]) == "forward"  # a closure's forward
    assert stacks.phase_of([user, module, c10d]) == "communication"
    assert stacks.where([user, module, Frame(site + "x.py", 3, "f")]) == (
        "train.py:9 in main (x.py:3 in f)")
    assert stacks.is_user_file("/home/me/train.py") and not stacks.is_user_file(site + "a.py")


def test_cuda_out_of_memory_reads_the_allocator_and_the_request() -> None:
    class Cuda:
        def is_initialized(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def memory_allocated(self, device: int) -> int:
            return 70 << 30

        def memory_reserved(self, device: int) -> int:
            return 75 << 30

        def get_device_properties(self, device: int) -> Any:
            return SimpleNamespace(total_memory=80 << 30)

    class OutOfMemoryError(RuntimeError):
        pass

    exc = OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has ...")
    assert out_of_memory_detail(exc, Cuda()) == {
        "allocated_bytes": 70 << 30, "reserved_bytes": 75 << 30, "capacity_bytes": 80 << 30,
        "requested_bytes": int(2.5 * (1 << 30))}
    assert out_of_memory_detail(ValueError("no"), Cuda()) == {}
