"""The agent's side of a profiler capture, in this process: a real runtime with its real
patches and batch watches, a real torch.profiler, the sender thread's ticks called by
hand; the steps checked through the collector's own step tracker."""

from __future__ import annotations

import gzip
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.unit.test_runtime import Collector, install
from traceml.agent.capture import _TraceFile
from traceml.agent.runtime import AgentRuntime
from traceml.environment import AgentEnv
from traceml.wire.captures import CaptureAsk, CaptureReport
from traceml.wire.envelope import Message
from traceml.wire.events import CLOSE
from traceml.wire.identity import Sender


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[AgentRuntime]:
    env = AgentEnv(session_id="unit", endpoint="tcp://127.0.0.1:9", launcher_pid=os.getppid(),
                   session_dir=str(tmp_path), flush_interval_s=0.0, count_flops=False)
    rt = AgentRuntime(env, Sender("rank", socket.gethostname(), os.getpid(), 0, rank=0))
    install(rt)
    rt.watch_batches()
    yield rt
    if rt.instrumentation is not None:
        rt.instrumentation.uninstall()


def ask(start_after: int, steps: int = 2, max_bytes: int = 10**8, cid: str = "c1") -> Any:
    return CaptureAsk(cid, (0,), start_after, steps, max_bytes).payload()


def train(rt: AgentRuntime, iterations: int, messages: list[Message],
          at: dict[int, Any] | None = None, manual: bool = False,
          batch: Callable[[int], Any] | None = None) -> None:
    """``iterations`` DataLoader iterations, a sender tick after each, and the control
    messages of ``at`` delivered after the iteration of their index."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(iterations * 8, 32), torch.randn(iterations * 8, 1))
    items = (DataLoader(data, batch_size=8) if batch is None
             else DataLoader(range(iterations), batch_size=None, collate_fn=batch))
    for i, item in enumerate(items):
        x, y = item if batch is None else (torch.randn(8, 32), torch.randn(8, 1))
        if manual:
            rt.step_enter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if manual:
            rt.step_exit()
        messages += rt._drain_events()
        if at and i in at:
            rt._on_control(at[i])


def finish(rt: AgentRuntime, messages: list[Message]) -> tuple[list[CaptureReport],
                                                                list[dict[str, Any]]]:
    rt.capture is None or rt.capture.stop()
    rt.probe.log(CLOSE)
    messages += rt._bye()
    reports = [m for m in messages if isinstance(m, CaptureReport)]
    return reports, Collector().steps(messages)


def profiled(report: CaptureReport, steps: list[dict[str, Any]]) -> list[int]:
    """The steps that ran while the capture did (the last one wrote its trace)."""
    assert report.began_at is not None and report.ended_at is not None
    return [s["step"] for s in steps if s["t_begin"] < report.ended_at
            and s["t_begin"] + s["total_ms"] / 1e3 > report.began_at]


def test_the_asked_steps_are_profiled_and_reported(runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 16, messages, at={2: ask(start_after=8)})
    (report,), steps = finish(runtime, messages)
    assert (report.num_steps, report.error, report.cut) == (2, None, None)
    # steps 8 and 9 (0-based), and step 10, whose start wrote the trace
    assert profiled(report, steps) == [8, 9, 10]
    names = {o.name for o in report.operators}
    assert "aten::addmm" in names and all(o.calls > 0 for o in report.operators)
    by_part = {o.name: o.part for o in report.operators}
    assert by_part["aten::addmm"] == "compute"
    assert by_part.get("Optimizer.step#SGD.step") == "optimizer"
    assert report.path is not None and os.path.getsize(report.path) == report.trace_bytes
    with gzip.open(report.path) as f:
        trace = json.load(f)
    assert trace["traceml"] == {"capture_id": "c1", "rank": 0, "steps": 2, "steps_asked": 2,
                                "cut": None}
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    assert len(steps) == 16
    # the hook is gone once the report left: later steps take the fast path again
    assert runtime.probe.on_optimizer_end is None


def test_a_repeated_ask_is_taken_once(runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 14, messages, at={1: ask(4), 2: ask(4), 10: ask(4)})
    reports, _ = finish(runtime, messages)
    assert [(r.capture_id, r.num_steps) for r in reports] == [("c1", 2)]


def test_a_trace_step_loop_counts_its_exits_not_its_optimizer_steps(
        runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 16, messages, at={2: ask(start_after=8)}, manual=True)
    (report,), steps = finish(runtime, messages)
    assert report.num_steps == 2 and report.error is None
    assert profiled(report, steps)[:2] == [8, 9]


def test_an_ask_for_a_step_that_passed_says_so(runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 10, messages, at={5: ask(start_after=2)})
    (report,), _ = finish(runtime, messages)
    assert report.num_steps == 0 and report.error is not None and "had passed" in report.error
    assert report.path is None


def test_batches_without_a_tensor_still_start_and_stop_it(runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 14, messages, at={1: ask(5)}, batch=lambda i: {"id": f"item-{i}"})
    (report,), _ = finish(runtime, messages)
    assert report.num_steps == 2 and report.error is None


def test_the_byte_cap_cuts_the_trace_and_says_so(runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 14, messages, at={1: ask(5, max_bytes=20_000)})
    (report,), _ = finish(runtime, messages)
    assert report.num_steps == 1 and report.cut is not None
    assert "cap of 20000 bytes after 1 of 2 steps" in report.cut
    assert report.path is not None
    with gzip.open(report.path) as f:
        trace = json.load(f)
    # the events as one array within the cap (to the byte: the test below)
    assert 0 < len(orjson.dumps(trace["traceEvents"])) <= 20_000


def test_the_cap_bounds_the_events_array_to_the_byte(tmp_path: Path) -> None:
    """The events as the trace's readers get them, one JSON array, hold at most the cap;
    the event that would pass it is dropped, whole."""
    events = [{"ph": "X", "name": f"aten::op{i}", "ts": 1.5 * i, "dur": 1.0}
              for i in range(20)]
    sizes = [len(json.dumps(e, separators=(",", ":")).encode()) for e in events]
    fits = 10
    cap = 2 + sum(sizes[:fits]) + fits - 1  # brackets, events, commas: exactly ten
    trace = _TraceFile(str(tmp_path / "t.json.gz"), cap)
    assert not trace.add({"traceEvents": events, "schemaVersion": 1})
    trace.close({"steps": 1})
    with gzip.open(tmp_path / "t.json.gz") as f:
        kept = json.load(f)["traceEvents"]
    assert kept == events[:fits]
    assert len(json.dumps(kept, separators=(",", ":"))) == cap == trace.size


def test_a_capture_open_when_the_sender_stops_is_closed_by_the_training_thread(
        runtime: AgentRuntime) -> None:
    """The sender thread died mid-capture: the profiler (which only the training thread
    can stop) is closed at the next iteration end, and only then does logging stop."""
    messages: list[Message] = []
    train(runtime, 8, messages, at={1: ask(4, steps=5)})
    assert runtime.capture is not None
    (c,) = runtime.capture._open
    assert c.session is not None and not runtime.probe.off
    runtime._sender_exited()
    assert not runtime.probe.off  # not yet: the session is open
    train(runtime, 2, messages)
    assert c.session is None and c.done and runtime.probe.off
    assert c.error == "traceml's sender stopped"


def test_a_failing_capture_leaves_the_steps_instrumented(runtime: AgentRuntime) -> None:
    messages: list[Message] = []
    train(runtime, 6, messages, at={1: ask(4, steps=3)})
    assert runtime.capture is not None
    runtime.capture._end_step = None  # type: ignore[assignment]  # the next end fails
    train(runtime, 4, messages)
    assert not runtime.probe.off
    (report,), steps = finish(runtime, messages)
    assert report.error is not None and "failed: TypeError" in report.error
    assert len(steps) == 10


def test_a_profiled_step_that_lasts_too_long_is_dropped_unread(
        runtime: AgentRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml.agent import capture

    monkeypatch.setattr(capture, "MAX_SESSION_S", 0.0)
    messages: list[Message] = []
    train(runtime, 10, messages, at={1: ask(4)})
    (report,), _ = finish(runtime, messages)
    assert report.num_steps == 0 and report.operators == ()
    assert report.cut is not None and "events were dropped unread" in report.cut


def test_a_tick_that_takes_a_batch_record_alone_sends_it(runtime: AgentRuntime) -> None:
    """A batch forced to the slow path (a capture's due work) may be the only thing
    logged since the last tick: the tick takes it without events (it stopped the sender
    thread once: min() of no event times)."""
    from traceml.wire.events import BATCH_FROM_FETCH

    messages: list[Message] = []
    train(runtime, 3, messages)
    for _ in range(2):  # nothing left held: the next tick takes the batch record alone
        messages += runtime._drain_events()
    assert not any(runtime.probe._held) and not any(runtime.probe.streams)
    runtime.probe.batches.append((runtime.probe.clock(), 8, None, None, BATCH_FROM_FETCH))
    messages += runtime._drain_events()
    train(runtime, 2, messages)
    _, steps = finish(runtime, messages)
    assert len(steps) == 5
