"""A process holding the session secret is unreadable to its own user: a rank (run
by the same user as its launcher) cannot read the secret in the launcher's
``/proc/<pid>/environ`` (`traceml.security.forbid_inspection`).  The processes run as
``nobody`` when the suite runs as root (root reads every process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# A "launcher" started with the secret in its environment takes it out of os.environ
# (as traceml run does) and, with `hide`, forbids inspection; its forked child (a "rank"
# of the same user) then reads the launcher's environment and memory map.
LAUNCHER = textwrap.dedent("""
    import ctypes, os, sys
    from traceml.security import forbid_inspection
    os.environ.pop("TRACEML_SECRET")
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
        # changing user made it undumpable: back to what any process of a user is
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
    if sys.argv[1] == "hide":
        assert forbid_inspection()
    launcher = os.getpid()
    rank = os.fork()
    if rank == 0:
        for name in ("environ", "maps"):
            try:
                with open(f"/proc/{launcher}/{name}", "rb") as f:
                    data = f.read()
                print(name, "secret" if b"s3cret-of-the-session" in data else "read", flush=True)
            except PermissionError:
                print(name, "denied", flush=True)
        os._exit(0)
    os.waitpid(rank, 0)
""")


@pytest.mark.parametrize("how", ["hide", "plain"])
def test_a_rank_cannot_read_its_launchers_secret(how: str) -> None:
    env = {**os.environ, "TRACEML_SECRET": "s3cret-of-the-session"}
    out = subprocess.run([sys.executable, "-c", LAUNCHER, how], env=env, cwd="/",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if how == "hide":
        assert out.stdout.split("\n")[:2] == ["environ denied", "maps denied"]
    else:  # what it guards against: the environment it started with, secret and all
        assert out.stdout.split("\n")[:2] == ["environ secret", "maps read"]
