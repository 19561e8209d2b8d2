"""torch.compile under the agent: dynamo's recompile messages name the model's
forward, not traceml's Module.__call__ wrapper (issue 21)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import logging, sys, time, torch
    from torch import nn
    from traceml.agent.patches import Instrumentation
    from traceml.agent.probe import Probe

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch._logging.set_logs(recompiles=True)
    inst = Instrumentation(Probe(time.perf_counter, print))
    inst.install()
    try:
        model = torch.compile(Net())
        for n in (2, 3, 5):  # each new batch size: a recompile
            model(torch.randn(n, 4)).sum().backward()
    finally:
        inst.uninstall()
""")


def test_a_recompile_names_the_models_forward(tmp_path: Path) -> None:
    script = tmp_path / "user_model.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    recompiles = [line for line in done.stderr.splitlines() if "Recompiling function" in line]
    assert recompiles, done.stderr[-3000:]
    assert all(f"forward in {script}" in line for line in recompiles), recompiles
    assert "traceml" not in "".join(recompiles)
