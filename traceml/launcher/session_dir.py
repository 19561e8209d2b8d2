"""The session folder and who runs its collector (launcher side): a launcher claims the
folder by creating its store file, exclusively, so that of two runs started at once
with one session id one stops, and on c10d the launchers of one host agree on who
hosts the collector."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from traceml.config import RunConfig
from traceml.errors import UsageError
from traceml.launcher import topology
from traceml.launcher.collector_process import READY_TIMEOUT_S, StoreUnwritable
from traceml.launcher.topology import Topology
from traceml.store import STORE_FILENAME, STORE_MODE, StoreError, StoreReader

PEER_COLLECTOR_S = READY_TIMEOUT_S + 10.0
"""c10d: how long a launcher that lost the session folder to a peer on its host
waits for that peer's collector to record the run's start (a collector that has
not started within `READY_TIMEOUT_S` gives the folder back)."""


def session_dir_for(cfg: RunConfig, topo: Topology) -> tuple[Path, bool]:
    """The session folder, and whether this launcher runs the collector: it claims
    the folder by creating the store file (exclusively: of two runs started at once
    with one session id, one stops here).

    On c10d, every launcher on the endpoint's host may run it (`Topology.may_host`),
    and they are nodes of one job: the one that claims the folder runs the collector;
    another connects once that collector has recorded the run's start, and claims
    the folder itself if the claimant gives it back (its collector could not start).
    A folder whose run has ended, or whose collector is gone, is refused."""
    path = Path(cfg.logs_dir) / cfg.session_id
    hosting = topo.collector_here or topo.may_host
    deadline = time.monotonic() + PEER_COLLECTOR_S
    while True:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if hosting:
                os.close(os.open(path / STORE_FILENAME,
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY, STORE_MODE))
            return path, hosting
        except FileExistsError:
            if not path.is_dir():
                raise _unwritable(cfg, path, "a file is in the way") from None
            peer = _peer_run(path / STORE_FILENAME, topo) if topo.may_host else "ended"
            if peer == "live":
                return path, False
            if peer == "ended":
                raise UsageError(f"traceml {cfg.command}: session folder {path} already holds "
                                 "a run; pass another --session-id or remove that folder") from None
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"traceml {cfg.command}: another launcher on this host claimed {path}, but "
                    f"its collector did not start within {PEER_COLLECTOR_S:.0f} s; pass "
                    "another --session-id or remove that folder") from None
            time.sleep(0.2)  # then claim again: the folder is free if the peer gave it back
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreUnwritable(f"traceml: warning: cannot create {path}: "
                                      f"{exc.strerror}") from None
            raise _unwritable(cfg, path, exc.strerror or str(exc)) from None


def _peer_run(store: Path, topo: Topology) -> str:
    """The run in a claimed session folder: ``live`` (its collector recorded the
    start and holds the port), ``ended`` (it recorded the end, or its collector is
    gone), or ``starting`` (nothing recorded yet: the claimant starts its collector)."""
    try:
        with StoreReader(store, timeout_s=1.0) as reader:
            records = reader.records()
    except StoreError:
        return "starting"  # not made yet, or given back
    if records.start is None:
        return "starting"
    if records.end is None and not topology.port_is_free(topo.bind_host, topo.port):
        return "live"
    return "ended"


def _unwritable(cfg: RunConfig, path: Path, reason: str) -> UsageError:
    return UsageError(f"traceml {cfg.command}: cannot write the session folder {path}: "
                      f"{reason}; give --logs-dir a folder you can write")
