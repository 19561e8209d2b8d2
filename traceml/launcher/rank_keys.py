"""The launcher's key service: each of its workers gets the token of its own rank, once
(launcher side).

A worker gets no session secret (`traceml.environment`), so it cannot compute any
token; it asks this service, over a Unix socket, which knows who asks from the
kernel (``SO_PEERCRED``, Linux): the asking process must descend from a direct child of
this launcher (a worker torch's elastic agent started: the process itself, or with
``--no-python`` the first Python process under it), and each such worker is answered
once, with the token of the rank torch gave it in its attempt (``RANK`` and
``TORCHELASTIC_RESTART_COUNT`` in its environment): each rank's attempt is
answered once, whatever its process id (a restarted worker may get an old one).  So a
rank's DataLoader workers and subprocesses, which ask as that worker again, get
nothing: whatever they send as any rank is refused and counted by the collector.

Elsewhere than Linux there is no ``SO_PEERCRED``: the service does not start, the
collector does not ask for tokens, and any holder of the session's client key may
speak as any rank of its node, as the README says.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
from pathlib import Path

import psutil

from traceml.environment import TorchRank
from traceml.security import TokenBook

REQUEST = b"token\n"
REFUSED = b"refused\n"
ACCEPT_TIMEOUT_S = 0.5  # how often the thread looks whether it was stopped


def available() -> bool:
    """Whether the kernel says who is at the other end of a Unix socket here."""
    return hasattr(socket, "SO_PEERCRED") and hasattr(socket, "AF_UNIX")


class RankKeyService:
    """A thread answering this launcher's workers with their rank's token."""

    def __init__(self, tokens: TokenBook) -> None:
        self.tokens = tokens
        self.launcher_pid = os.getpid()
        self.issued: set[tuple[int, int]] = set()  # (rank, attempt) answered
        self.num_refused = 0
        self.folder = Path(tempfile.mkdtemp(prefix="traceml-keys-"))  # 0700
        self.path = str(self.folder / "keys.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._sock.settimeout(ACCEPT_TIMEOUT_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="traceml-keys", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * ACCEPT_TIMEOUT_S)
        self._sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    if conn.recv(len(REQUEST)) == REQUEST:
                        conn.sendall(self.answer(_peer_pid(conn)))
                except OSError:
                    pass  # the asker went away: it gets nothing

    def answer(self, pid: int) -> bytes:
        """The token line for process ``pid``, or the refusal (counted)."""
        worker = self.worker_of(pid)
        attempt = _rank_of(worker) if worker is not None else None
        if attempt is None or attempt in self.issued:
            self.num_refused += 1
            return REFUSED
        self.issued.add(attempt)
        return self.tokens.rank(*attempt).encode("ascii") + b"\n"

    def worker_of(self, pid: int) -> int | None:
        """The worker ``pid`` belongs to: itself or its ancestor whose parent is this
        launcher (None: not a descendant of one)."""
        try:
            process = psutil.Process(pid)
            for p in (process, *process.parents()):
                if p.ppid() == self.launcher_pid:
                    return int(p.pid)
        except psutil.Error:
            return None
        return None


def _peer_pid(conn: socket.socket) -> int:
    pid: int = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   struct.calcsize("3i")))[0]
    return pid


def _rank_of(pid: int) -> tuple[int, int] | None:
    """The rank and attempt torch's elastic agent gave worker ``pid`` (``RANK`` and
    ``TORCHELASTIC_RESTART_COUNT`` of its environment)."""
    try:
        worker = TorchRank.from_env(psutil.Process(pid).environ())
    except (psutil.Error, ValueError):
        return None
    return (worker.rank, worker.restart_count) if worker is not None else None
