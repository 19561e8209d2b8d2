"""The records the store takes and gives back besides the diagnosis' samples: a
rank's finished step, a sender's counters, a join error, the run's records, a
stored step and the rows added after a rowid (shared: the collector writes them;
the launcher, offline analysis and the live views read them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from traceml import phases
from traceml.protocol import RunEnd, RunStart, Sender
from traceml.records import StepRow
from traceml.store.schema import STEP_COLUMNS


@dataclass(frozen=True)
class StepRecord:
    """One finished step of a rank as the collector stores it (times in ms)."""

    step: int
    t_begin: float  # unix seconds
    total_ms: float
    wait_ms: float
    phase_ms: tuple[float, ...]  # per phase of `traceml.phases.PHASES`
    counts: tuple[int, ...]  # calls per phase
    num_skipped: int = 0  # GradScaler steps that skipped the update
    rss_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    gpu_ms: tuple[float | None, ...] = ()  # per GPU-timed phase; empty off CUDA
    collective_ms: float | None = None  # any collective in flight; None: none timed
    samples: int | None = None  # in the step's batches; None: not measured
    tokens: int | None = None
    flops: float | None = None  # per step, from the latest count; None: not known
    flops_counted: bool = False  # the FLOP counter ran in this step
    boundary: str = phases.STEP_BOUNDARIES[0]  # what ended the step
    eval_ms: float = 0.0  # evaluation wall time that ended where the step began
    num_eval: int = 0  # ...in this many evaluation passes

    def values(self) -> tuple[Any, ...]:
        """The record in :data:`STEP_COLUMNS` order."""
        gpu = self.gpu_ms or (None,) * len(phases.gpu_timed())
        return (self.step, self.t_begin, self.total_ms, self.wait_ms, *self.phase_ms,
                *self.counts, self.num_skipped, self.rss_bytes, self.peak_allocated_bytes,
                self.peak_reserved_bytes, *gpu, self.collective_ms, self.samples, self.tokens,
                self.flops, int(self.flops_counted), self.boundary, self.eval_ms, self.num_eval)

    def columns(self) -> dict[str, Any]:
        """The record by :data:`STEP_COLUMNS` name."""
        return dict(zip(STEP_COLUMNS, self.values()))


@dataclass
class SenderState:
    """One sender as the collector tracks it between messages: a row of ``senders``."""

    sender: Sender
    first_seen: float  # unix seconds
    last_seen: float
    num_messages: int = 0
    num_gaps: int = 0
    last_seq: int = -1
    num_sent: int = 0
    num_dropped: int = 0
    said_bye: bool = False

    def counters(self) -> list[Any]:
        """Every field after ``sender``, in order: how a relay forwards a state
        (``SenderState(sender, *counters)`` takes it back), how it is stored."""
        return [self.first_seen, self.last_seen, self.num_messages, self.num_gaps,
                self.last_seq, self.num_sent, self.num_dropped, self.said_bye]


@dataclass(frozen=True, order=True)
class JoinError:
    """A node whose options did not match node 0's, as the collector answered it."""

    at: float  # unix seconds
    problem: str  # the one line both launchers print


@dataclass(frozen=True)
class RunRecords:
    """What the store holds about the run besides its samples."""

    start: RunStart | None  # None: the launcher's record never arrived
    end: RunEnd | None  # None: the run has not ended (or its launcher died)
    senders: tuple[SenderState, ...]
    rejected: Mapping[str, int]  # messages dropped, by reason
    # When the collector saw its launcher vanish before the end (None: it did not).
    launcher_lost_at: float | None = None
    launcher_lost_role: str = "launcher"  # or "process": traceml.init()'s training process


@dataclass(frozen=True)
class StoredStep:
    """A step row and the attempt (restart) of its rank that ran it."""

    restart: int
    row: StepRow


_T = TypeVar("_T")


@dataclass(frozen=True)
class NewRows(Generic[_T]):
    """Rows added after a rowid, oldest first, and the rowid to read after next time."""

    rows: tuple[_T, ...]
    last_row_id: int
