"""2-rank gloo DDP that stalls or crashes on one rank (never imports traceml).

``--case`` (on ``--bad-rank``, at step ``--at``):
  python   blocks forever in Python inside its model's forward
  gil      blocks in a C call that holds the GIL after its optimizer step, once the
           collector stored its steps so far
  loader   its DataLoader worker hangs fetching that step's batch
  pause    pauses ``--pause-s`` inside forward, then trains on to ``--steps``
  raise    raises ValueError inside forward
  segv     kills itself with SIGSEGV inside forward
  setup    raises before the first step
  none     trains ``--steps`` steps (the test kills a rank from outside)

Each rank writes its pid to ``$EVIDENCE_DIR/pid-<rank>`` once it trains.
"""

import argparse
import contextlib
import ctypes
import os
import signal
import sqlite3
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.trouble = ""
        self.pause_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trouble == "python":
            threading.Event().wait()  # BLOCK-PYTHON
        if self.trouble == "pause":
            self.trouble = ""
            time.sleep(self.pause_s)  # PAUSE
        if self.trouble == "raise":
            raise ValueError("bad batch on this rank")  # RAISE
        if self.trouble == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)  # SEGV
        time.sleep(0.004)
        return self.layers(x)


class Batches(Dataset):
    """Random batches; ``hang_at`` makes the worker hang on that item."""

    def __init__(self, n: int, hang_at: int | None) -> None:
        self.n, self.hang_at = n, hang_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.hang_at:
            threading.Event().wait()  # HANG-LOADER
        return torch.randn(8, 32), torch.randn(8, 1)


def wait_for_stored_steps(rank: int, num_steps: int, timeout_s: float = 30.0) -> None:
    """Poll the session's store until it holds ``num_steps`` of ``rank``'s steps
    (no wait outside traceml)."""
    session_dir = os.environ.get("TRACEML_SESSION_DIR")
    if session_dir is None:
        return
    store = os.path.join(session_dir, "telemetry.sqlite")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True,
                                                    timeout=1.0)) as db:
                (stored,) = db.execute("SELECT COUNT(*) FROM steps WHERE rank = ?",
                                       (rank,)).fetchone()
            if stored >= num_steps:
                return
        except sqlite3.Error:
            pass  # not created yet, or busy
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="none")
    parser.add_argument("--bad-rank", type=int, default=1)
    parser.add_argument("--at", type=int, default=30)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--pause-s", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bad = rank == args.bad_rank
    if bad and args.case == "setup":
        raise RuntimeError("cannot open the dataset")  # SETUP
    torch.manual_seed(rank)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hang_at = args.at if bad and args.case == "loader" else None
    loader = DataLoader(Batches(args.steps, hang_at), batch_size=None, num_workers=1)
    evidence = os.environ.get("EVIDENCE_DIR")
    if evidence:
        with open(os.path.join(evidence, f"pid-{rank}"), "w") as f:
            f.write(str(os.getpid()))
    libc = ctypes.PyDLL(None)  # its calls hold the GIL
    libc.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    for step, (x, y) in enumerate(loader):
        if bad and step == args.at and args.case in ("python", "pause", "raise", "segv"):
            net.trouble, net.pause_s = args.case, args.pause_s
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bad and step == args.at and args.case == "gil":
            # The GIL free until the collector stored its steps so far (its sender
            # ships them every 0.5 s): the test waits for them before timing the alert.
            wait_for_stored_steps(rank, args.at - 1)
            # read() of a pipe nobody writes: restarted after the launcher's stack
            # signal (faulthandler's handler is SA_RESTART), so Python never runs
            # again on this rank, as in a C extension blocked in a system call.
            never, _ = os.pipe()
            while True:  # Ctrl-C's EINTR ends read() with -1: Python raises KeyboardInterrupt
                libc.read(never, ctypes.create_string_buffer(1), 1)  # BLOCK-GIL
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
