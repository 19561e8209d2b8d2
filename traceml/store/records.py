"""The records the store takes and gives back besides the shared ones of
`traceml.records` (steps, samples, incidents): a sender's counters, a join error, the
run's records and the rows added after a rowid (shared: the collector writes them;
the launcher, offline analysis and the live views read them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from traceml.clocks import Exchange
from traceml.wire.identity import Sender
from traceml.wire.records import RunEnd, RunStart


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
    # How the collector's metrics exports went, by exporter (`traceml.live.otlp`).
    exports: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Each node launcher's (host, pid) best exchange per burst against node 0's clock.
    clock_exchanges: tuple[tuple[str, int, Exchange], ...] = ()
    # (host, pid) of the launcher the exchanges were answered for (the collector's node)
    clock_reference: tuple[str, int] | None = None


_T = TypeVar("_T")


@dataclass(frozen=True)
class NewRows(Generic[_T]):
    """Rows added after a rowid, oldest first, and the rowid to read after next time."""

    rows: tuple[_T, ...]
    last_row_id: int
