"""The launcher's key service (traceml/launcher/rank_keys.py) over a real Unix socket,
with real child processes: a worker of the launcher (here, of this test) gets its rank's
token once; a second ask, its children, a process with no rank and one outside the
launcher's tree get nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from traceml.launcher import rank_keys
from traceml.launcher.rank_keys import RankKeyService
from traceml.security import TokenBook

pytestmark = pytest.mark.skipif(not rank_keys.available(), reason="Linux only (SO_PEERCRED)")
BOOK = TokenBook("s3cret", "sess")
ASK = "from traceml.agent.runtime import ask_token\nprint(ask_token(sys.argv[1]), flush=True)\n"
CHILD = "subprocess.run([sys.executable, '-c', 'import sys\\n' + ASK, sys.argv[1]], check=True)\n"


@pytest.fixture
def service() -> Iterator[RankKeyService]:
    keys = RankKeyService(BOOK)
    yield keys
    keys.stop()


def _worker(code: str, path: str, rank: str = "3") -> list[str]:
    """What a child of this process says, started as torch's elastic agent starts a worker
    (``RANK`` in its environment)."""
    env = {"RANK": rank, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "ASK": ASK}
    prelude = "import os, subprocess, sys\nASK = os.environ['ASK']\n"
    done = subprocess.run([sys.executable, "-c", prelude + code, path], capture_output=True,
                          text=True, env=env, timeout=60, check=True)
    return done.stdout.split()


def test_a_worker_gets_its_ranks_token_once(service: RankKeyService) -> None:
    assert _worker(ASK + ASK, service.path) == [BOOK.rank(3), "None"]
    assert len(service.issued) == 1 and service.num_refused == 1


def test_a_workers_child_gets_nothing(service: RankKeyService) -> None:
    """The worker asks first (its agent does as it starts), then its child asks."""
    assert _worker(ASK + CHILD, service.path, rank="1") == [BOOK.rank(1), "None"]


def test_a_child_that_asks_first_takes_its_workers_answer(service: RankKeyService) -> None:
    """With ``--no-python`` the first Python process under a worker asks: the token is
    the worker's rank's, and the worker itself gets nothing after."""
    assert _worker(CHILD + ASK, service.path, rank="2") == [BOOK.rank(2), "None"]


def test_no_rank_or_outside_the_launchers_tree_gets_nothing(service: RankKeyService,
                                                            tmp_path: Path) -> None:
    assert _worker(ASK, service.path, rank="") == ["None"]
    # An orphan, re-parented away from this process by a double fork, with a RANK.
    out = tmp_path / "answer"
    orphan = ("parent = os.getpid()\nif os.fork():\n    os._exit(0)\n"
              "import time\nuntil = time.monotonic() + 30\n"
              "while os.getppid() == parent and time.monotonic() < until:\n"
              "    time.sleep(0.01)\n"
              "from traceml.agent.runtime import ask_token\n"
              f"open({str(out)!r}, 'w').write(str(ask_token(sys.argv[1])))\n")
    _worker(orphan, service.path, rank="0")
    assert wait_until(lambda: out.exists() and out.read_text() != "")
    assert out.read_text() == "None"


def test_each_ranks_attempt_is_answered_once_whatever_its_pid(service: RankKeyService) -> None:
    """A restarted worker (torch's next attempt) may be given an old worker's pid: it is
    answered as long as its rank's attempt was not; the same attempt again is not."""
    service.issued.add((4, 0))  # rank 4's first attempt was answered, by any pid
    assert _worker(ASK, service.path, rank="4") == ["None"]
    restarted = {"TORCHELASTIC_RESTART_COUNT": "1"}
    env = {"RANK": "4", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **restarted}
    done = subprocess.run([sys.executable, "-c", "import sys\n" + ASK, service.path],
                          capture_output=True, text=True, env=env, timeout=60, check=True)
    assert done.stdout.split() == [BOOK.rank(4, 1)]
    assert service.issued == {(4, 0), (4, 1)}
