"""AgentRuntime in this process, its sender thread not started: the sender's
side (replay, stamping, the last flush) is driven by hand on real patches."""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from traceml import protocol
from traceml.agent.patches import Instrumentation
from traceml.agent.runtime import AgentRuntime
from traceml.agent.steps import CLOSE, MARK
from traceml.environment import AgentEnv
from traceml.protocol import Sender


@pytest.fixture
def runtime() -> Iterator[AgentRuntime]:
    env = AgentEnv(session_id="unit", endpoint="tcp://127.0.0.1:9", launcher_pid=os.getppid())
    rt = AgentRuntime(env, Sender("rank", socket.gethostname(), os.getpid(), 0, rank=0))
    yield rt
    if rt.instrumentation is not None:
        rt.instrumentation.uninstall()


def install(rt: AgentRuntime) -> None:
    rt.instrumentation = Instrumentation(rt.probe)
    rt.instrumentation.install()


def train(iterations: int) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(iterations * 4, 8), torch.randn(iterations * 4, 1))
    for x, y in DataLoader(data, batch_size=4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def sent_steps(messages: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind, payload in messages:
        if kind == protocol.KIND_STEPS:
            fields, values = protocol.iter_rows(
                {"fields": payload["fields"], "rows": [list(r) for r in payload["rows"]]})
            rows += [dict(zip(fields, row)) for row in values]
    return rows


def test_the_last_flush_replays_everything_up_to_exit(runtime: AgentRuntime) -> None:
    install(runtime)
    train(5)
    runtime.probe.log((CLOSE, 0.0))  # what shutdown logs before stopping the sender
    messages = runtime._bye()
    steps = sent_steps(messages)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all((s["num_input"], s["num_forward"], s["num_backward"], s["num_optimizer"])
               == (1, 1, 1, 1) for s in steps)
    assert messages[-1] == (protocol.KIND_BYE, {"num_steps": 5, "t": messages[-1][1]["t"]})


def test_a_replay_error_turns_the_agent_off_and_training_goes_on(
        runtime: AgentRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    install(runtime)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("tracker bug")

    runtime.tracker._finish = broken  # type: ignore[method-assign]
    train(3)
    runtime._drain_steps()  # the sender thread's tick
    assert runtime.probe.off
    assert "tracker bug" in capsys.readouterr().err
    # The patches stay (removing a hook from the sender thread could break the
    # training thread's loop over them) but pass straight through.
    assert nn.Module.__call__ is not runtime.instrumentation.patches[1].original
    left = len(runtime.probe.events)
    train(3)
    assert len(runtime.probe.events) == left  # nothing logged any more
    runtime._drain_steps()
    assert capsys.readouterr().err == ""  # warned once


class TickingModel(nn.Module):
    """A model during whose forward the sender thread ticks: the replay leaves
    that forward open in the tracker."""

    def __init__(self, runtime: AgentRuntime) -> None:
        super().__init__()
        self.runtime = runtime
        self.layer = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runtime._drain_steps()
        return self.layer(x)


def test_an_overflowing_log_resynchronises(runtime: AgentRuntime) -> None:
    runtime.probe.events = deque(maxlen=24)  # 3 iterations of events: the cut log starts at a fetch
    runtime.probe.log = runtime.probe.events.append
    install(runtime)
    TickingModel(runtime)(torch.randn(4, 8)).sum().backward()
    train(7)  # the sender thread starved: the log overflowed, that forward's end is lost
    steps = sent_steps(runtime._drain_steps())
    train(2)  # 18 events: no second overflow
    runtime.probe.log((CLOSE, 0.0))
    steps += sent_steps(runtime._bye())
    assert len(steps) >= 3
    assert all(s["num_forward"] == 1 and s["num_optimizer"] == 1 for s in steps)


def test_trace_step_exit_keeps_the_device_mark_in_its_step(runtime: AgentRuntime) -> None:
    """On CUDA, step_exit logs the step's memory peaks and CUDA spans (a stand-in
    mark here): they must land in the step that is ending."""
    runtime.probe.on_optimizer_end = lambda: runtime.probe.log((MARK, ((1, 2), None)))
    install(runtime)
    model = nn.Linear(8, 1)
    with torch.no_grad():
        for _ in range(3):  # an inference loop: no optimizer, manual boundaries
            runtime.step_enter()
            with torch.enable_grad():
                model(torch.randn(4, 8))
            runtime.step_exit()
    runtime.probe.log((CLOSE, 0.0))
    steps = sent_steps(runtime._bye())
    assert len(steps) == 3
    assert all((s["peak_allocated_bytes"], s["peak_reserved_bytes"]) == (1, 2)
               for s in steps)
