"""The one place that reads and writes ``TRACEML_*`` environment variables,
and that reads torch's rank variables (launcher and agent side).

The launcher writes them into the environment it hands to torch's elastic
agent (so every worker inherits them); the agent bootstrap inside a worker
reads them.  Nothing else touches ``TRACEML_*`` variables, and the agent never
writes into a user's ``os.environ``.

Variables:

``TRACEML_SESSION_ID``
    Session this worker belongs to.  Its presence is what arms the agent.
``TRACEML_ENDPOINT``
    ZeroMQ address of the collector's PULL socket, e.g. ``tcp://127.0.0.1:29765``.
``TRACEML_LAUNCHER_PID``
    PID of the launcher whose elastic agent spawns the workers.  Only a process
    whose parent is this PID is a training rank (DataLoader workers, compile
    workers and unrelated subprocesses stay inert).
``TRACEML_ARM_DIR``
    Set with ``--no-python``: the worker command is not Python itself, so the
    first Python process of each rank arms, claimed by an exclusive marker file
    in this directory.
``TRACEML_MODE``
    ``run`` (full instrumentation) or ``watch`` (process telemetry only).
``TRACEML_NODE_RANK``
    Node rank of the launcher, as it knows it.
``TRACEML_SAMPLE_INTERVAL``
    Seconds between process telemetry samples.
``TRACEML_FLUSH_INTERVAL``
    Seconds between batched sends of step samples.
``TRACEML_SESSION_DIR``
    The session folder on node 0 (``logs/<session>``), where ``traceml.summary()``
    reads the store when it can.
``TRACEML_STALL_TIMEOUT``
    Seconds without progress before a rank reports a stall; ``auto`` (the
    default) adapts to the step time, ``0`` turns stall reports off.
``TRACEML_NO_FLOPS``
    ``1`` with ``--no-flops``: the agent counts no FLOPs (samples and tokens stay).
``TRACEML_CLIENT_KEYS``
    The collector's public key and the session's client key pair (z85, ``,``-
    separated, `traceml.security.client_keys_text`): what a worker connects with.
    The session secret itself never reaches a worker.
``TRACEML_KEY_SOCKET``
    The launcher's key service (a Unix socket, `traceml.launcher.rank_keys`): a
    worker asks it, once, for the token of its own rank.
``TRACEML_CONTROL``
    ZeroMQ address of the control channel of this node's collector or relay (a
    CURVE PUB): node 0's asks for profiler captures reach the ranks there.
``TRACEML_RANK_TOKEN``
    The token itself, where the process that runs the agent made it
    (``traceml.init()``); a launcher never sets it.

Set by the user (read by the launcher, never passed on to the workers):

``TRACEML_SECRET``
    The session secret the CURVE keys and tokens derive from; the same value on
    every node.
``TRACEML_SECRET_FILE``
    A file holding the session secret; it must not be readable by group or
    others (``chmod 600``).  Without either: on one node the launcher makes a
    random secret for the run; several nodes refuse to start.

Test-only (never set in a real job; the launcher's ranks inherit it):

``TRACEML_TEST_CLOCK_SKEW_S``
    Shifts a launcher's clock exchanges, and its ranks' step times, by this many
    seconds (`traceml.clocks`), so that two launchers on one host act as two
    nodes whose clocks disagree.

Set by torch's elastic agent in every worker (read only, into `TorchRank`):
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK`` (the node rank) and
``TORCHELASTIC_RESTART_COUNT``.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from traceml.errors import UsageError

PREFIX = "TRACEML_"
SECRET_HINT = ("set TRACEML_SECRET, or TRACEML_SECRET_FILE (chmod 600), to the same value "
               "on every node")
SECRET_EXAMPLE = ("export TRACEML_SECRET=$(python3 -c 'import secrets; "
                  "print(secrets.token_hex(32))')")


@dataclass(frozen=True)
class AgentEnv:
    """What a worker needs to know to arm its agent."""

    session_id: str
    endpoint: str
    launcher_pid: int
    mode: str = "run"
    node_rank: int = 0
    sample_interval_s: float = 1.0
    flush_interval_s: float = 0.5
    arm_dir: str | None = None
    session_dir: str | None = None
    client_keys: str | None = None  # `security.client_keys_text`
    key_socket: str | None = None
    rank_token: str | None = None
    stall_timeout_s: float | None = None  # None: automatic; 0: off
    count_flops: bool = True
    control_endpoint: str | None = None  # node 0's asks (`traceml.wire.captures`)

    def to_env(self) -> dict[str, str]:
        env = {
            "TRACEML_SESSION_ID": self.session_id,
            "TRACEML_ENDPOINT": self.endpoint,
            "TRACEML_LAUNCHER_PID": str(self.launcher_pid),
            "TRACEML_MODE": self.mode,
            "TRACEML_NODE_RANK": str(self.node_rank),
            "TRACEML_SAMPLE_INTERVAL": repr(self.sample_interval_s),
            "TRACEML_FLUSH_INTERVAL": repr(self.flush_interval_s),
            "TRACEML_STALL_TIMEOUT": ("auto" if self.stall_timeout_s is None
                                      else repr(self.stall_timeout_s)),
        }
        if self.arm_dir is not None:
            env["TRACEML_ARM_DIR"] = self.arm_dir
        if self.session_dir is not None:
            env["TRACEML_SESSION_DIR"] = self.session_dir
        for name, value in (("TRACEML_CLIENT_KEYS", self.client_keys),
                            ("TRACEML_KEY_SOCKET", self.key_socket),
                            ("TRACEML_RANK_TOKEN", self.rank_token),
                            ("TRACEML_CONTROL", self.control_endpoint)):
            if value is not None:
                env[name] = value
        if not self.count_flops:
            env["TRACEML_NO_FLOPS"] = "1"
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AgentEnv | None:
        """Read the contract back; None when this process is not traced."""
        session_id = environ.get("TRACEML_SESSION_ID")
        if not session_id:
            return None
        return cls(
            session_id=session_id,
            endpoint=environ["TRACEML_ENDPOINT"],
            launcher_pid=int(environ["TRACEML_LAUNCHER_PID"]),
            mode=environ.get("TRACEML_MODE", "run"),
            node_rank=int(environ.get("TRACEML_NODE_RANK", "0")),
            sample_interval_s=float(environ.get("TRACEML_SAMPLE_INTERVAL", "1.0")),
            flush_interval_s=float(environ.get("TRACEML_FLUSH_INTERVAL", "0.5")),
            arm_dir=environ.get("TRACEML_ARM_DIR"),
            session_dir=environ.get("TRACEML_SESSION_DIR"),
            client_keys=environ.get("TRACEML_CLIENT_KEYS"),
            key_socket=environ.get("TRACEML_KEY_SOCKET"),
            rank_token=environ.get("TRACEML_RANK_TOKEN"),
            stall_timeout_s=parse_stall_timeout(environ.get("TRACEML_STALL_TIMEOUT", "auto")),
            count_flops=environ.get("TRACEML_NO_FLOPS") != "1",
            control_endpoint=environ.get("TRACEML_CONTROL") or None,
        )


CLOCK_SKEW_VAR = "TRACEML_TEST_CLOCK_SKEW_S"
MAX_CLOCK_SKEW_S = 3600.0


def clock_skew_for_tests_s(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds ``TRACEML_TEST_CLOCK_SKEW_S`` shifts this process's clocks by (test-only,
    never set in a real job: `traceml.clocks`): a launcher's clock exchanges and its
    ranks' step times.  0 unless it holds a number within an hour."""
    try:
        skew = float(environ.get(CLOCK_SKEW_VAR, "0") or 0)
    except ValueError:
        return 0.0
    return skew if math.isfinite(skew) and abs(skew) <= MAX_CLOCK_SKEW_S else 0.0


def parse_stall_timeout(text: str) -> float | None:
    """``auto`` (None) or seconds, finite and >= 0 (0: off); ValueError otherwise.  The
    one parser of the option (`--stall-timeout`) and of ``TRACEML_STALL_TIMEOUT``."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"must be auto, 0 (off) or seconds > 0, got {text}")
    return value


def user_secret(environ: Mapping[str, str]) -> str | None:
    """The session secret the user gave, if any (launcher side)."""
    if environ.get("TRACEML_SECRET"):
        return environ["TRACEML_SECRET"]
    path = environ.get("TRACEML_SECRET_FILE")
    if not path:
        return None
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"traceml: TRACEML_SECRET_FILE {path} is readable by others; "
                             f"run 'chmod 600 {path}'")
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise UsageError(f"traceml: cannot read TRACEML_SECRET_FILE {path}: "
                         f"{exc.strerror}") from None
    if not secret:
        raise UsageError(f"traceml: TRACEML_SECRET_FILE {path} is empty")
    return secret


@dataclass(frozen=True)
class TorchRank:
    """Who a worker is, as torch's elastic agent told it in its environment."""

    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    group_rank: int | None = None  # the node rank torch assigned (None: not said)
    restart_count: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TorchRank | None:
        """Read torch's variables; None without ``RANK`` (not a worker torch started)."""
        rank = _int_var(environ, "RANK")
        if rank is None:
            return None
        return cls(
            rank=rank,
            local_rank=_int_var(environ, "LOCAL_RANK"),
            world_size=_int_var(environ, "WORLD_SIZE"),
            group_rank=_int_var(environ, "GROUP_RANK"),
            restart_count=_int_var(environ, "TORCHELASTIC_RESTART_COUNT") or 0,
        )


def _int_var(environ: Mapping[str, str], name: str) -> int | None:
    """An integer variable; None when unset or empty."""
    value = environ.get(name)
    return int(value) if value else None


def distributed_launch(environ: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun or another) started this process as a rank
    of a job with more than one process.  Reads torch's variables, not ours."""
    return (_int_var(environ, "WORLD_SIZE") or 1) > 1


def current() -> AgentEnv | None:
    """The contract of this process, read from ``os.environ``."""
    return AgentEnv.from_env(os.environ)


USER_SECRETS = ("TRACEML_SECRET", "TRACEML_SECRET_FILE")
"""The user's secret: the launcher reads it and takes it out of what its workers inherit."""


def hide_user_secret(environ: MutableMapping[str, str]) -> None:
    """Take the user's session secret out of ``environ`` (the launcher's own, which its
    workers inherit): a rank gets its own token instead."""
    for name in USER_SECRETS:
        environ.pop(name, None)


def without_traceml(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` with every ``TRACEML_*`` variable removed."""
    return {k: v for k, v in environ.items() if not k.startswith(PREFIX)}
