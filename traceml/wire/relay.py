"""A node's relay batch to node 0's collector (wire: `traceml.collector.relay` builds
it, node 0 takes it from the relays' key alone).

One message per relay flush: the states of the node's senders (an identity and
`RELAY_STATE_FIELDS` each), their steps (columnar: the sender's index in ``senders``,
then one list per measured column of `traceml.step_fields`), FLOP counts
``[index, time, *FLOP_COUNT_FIELDS]``, process and system samples by sender index,
incidents the relay placed at the rank's step (`RelayedIncident`), stalls that
cleared (``(id, at)``) and the relay's rejections by reason.  Decoding checks every
value as the kind's own decode would, except the step rows' values: their shape
only (the relay checked the events they came from; the store's reader checks each
value it loads, column by column).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from traceml import step_fields
from traceml.errors import ProtocolError
from traceml.wire.checks import TIME, escaped, lists, records
from traceml.wire.events import FLOP_COUNT_CHECKS
from traceml.wire.identity import MAX_NODES, NUM_SENDER_VALUES, Sender, sender_from
from traceml.wire.incidents import IncidentReport
from traceml.wire.rows import ProcessRows, SystemRows

RELAY_STATE_FIELDS = ("first_seen", "last_seen", "num_messages", "num_gaps", "last_seq",
                      "num_sent", "num_dropped", "said_bye")
MAX_RELAYED_SENDERS = 4096
MAX_RELAYED_STEPS = 1 << 20  # step rows in one batch (a node's ranks over one flush)
MAX_REJECT_REASONS = 64
MAX_REASON_CHARS = 200

_MEASURED = step_fields.measured()


@dataclass(frozen=True)
class RelayedIncident:
    """A stall or crash the relay placed at its rank's step (node 0 stores it)."""

    row_id: int  # the relay's own number for it: a later clear names it
    node_rank: int
    cleared_at: float | None
    step: int | None
    phase: str | None
    open_phases: tuple[str, ...]
    report: IncidentReport

    def values(self) -> list[Any]:
        return [self.row_id, self.node_rank, self.cleared_at, self.step, self.phase,
                list(self.open_phases), self.report.payload()]


@dataclass(frozen=True)
class RelayBatch:
    """What a relay forwards in one message."""

    KIND: ClassVar[str] = "relay"

    senders: list[tuple[Sender, list[Any]]]  # identity, RELAY_STATE_FIELDS values
    step_columns: list[list[Any]]  # [sender index, *one list per measured column], or []
    flop_counts: list[list[Any]]  # [sender index, time, *FLOP_COUNT_FIELDS]
    process: list[tuple[int, ProcessRows]]
    system: list[tuple[int, SystemRows]]
    incidents: list[RelayedIncident]
    clears: list[tuple[int, float]]  # (row id, when the stall ended)
    rejected: dict[str, int]

    def payload(self) -> dict[str, Any]:
        return {"senders": [[*s.values(), *state] for s, state in self.senders],
                "steps": self.step_columns, "flops": self.flop_counts,
                "process": [[i, rows.payload()] for i, rows in self.process],
                "system": [[i, rows.payload()] for i, rows in self.system],
                "incidents": [i.values() for i in self.incidents],
                "clears": [list(c) for c in self.clears], "rejected": self.rejected}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> RelayBatch:
        """A relay payload, checked whole; ProtocolError for anything else."""
        senders = _senders(payload.get("senders"))
        n = len(senders)
        parts: list[Any] = [payload.get(k) for k in ("steps", "flops", "process", "system",
                                                     "incidents", "clears")]
        if not all(lists(p) for p in parts):
            raise ProtocolError("relayed records are not lists")
        steps, flops, process, system, incidents, clears = parts
        _step_columns(steps, n)
        if (not all(len(r) == 2 and isinstance(r[1], dict) for r in [*process, *system])
                or not all(flops) or not records([r[1:] for r in flops], FLOP_COUNT_CHECKS)):
            raise ProtocolError("relayed records are not lists of their shape")
        if not all(type(r[0]) is int and 0 <= r[0] < n for r in [*flops, *process, *system]):
            raise ProtocolError("relayed record of no relayed sender")
        return cls(senders, steps, flops,
                   [(i, ProcessRows.from_payload(p)) for i, p in process],
                   [(i, SystemRows.from_payload(p)) for i, p in system],
                   [_incident(r) for r in incidents], [_clear(r) for r in clears],
                   _rejected(payload.get("rejected")))


def _senders(value: Any) -> list[tuple[Sender, list[Any]]]:
    if not lists(value, NUM_SENDER_VALUES + len(RELAY_STATE_FIELDS)) \
            or len(value) > MAX_RELAYED_SENDERS:
        raise ProtocolError("relayed senders are not identities with their states")
    try:
        senders = [(sender_from(s[:NUM_SENDER_VALUES]), s[NUM_SENDER_VALUES:]) for s in value]
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"relayed sender: {exc}") from None
    for _, state in senders:
        if not (all(TIME(t) for t in state[:2]) and state[-1] in (True, False)
                and all(type(v) is int and v >= -1 for v in state[2:-1])):
            raise ProtocolError("relayed sender state out of range")
    return senders


def _step_columns(columns: list[list[Any]], num_senders: int) -> None:
    """Relayed step rows: the measured columns (`traceml.step_fields`), of one length,
    each row of a relayed sender.  Their values are not checked here, one by one or
    column by column: the relay built them from events it checked, the writer
    refuses a rank's run whose steps or sums it cannot compute with, and the store's
    reader checks every value it loads (a stored file can be edited anyway)."""
    if not columns:
        return
    if len(columns) != 1 + len(_MEASURED) or len({len(c) for c in columns}) != 1:
        raise ProtocolError("relayed steps are not the measured columns, of one length")
    if not all(type(c) is list for c in columns):
        raise ProtocolError("relayed step columns are not lists")
    if len(columns[0]) > MAX_RELAYED_STEPS:
        raise ProtocolError("more relayed steps than a batch holds")
    index = columns[0]
    if set(map(type, index)) != {int} or min(index) < 0 or max(index) >= num_senders:
        raise ProtocolError("relayed step of no relayed sender")


def _incident(record: list[Any]) -> RelayedIncident:
    """``[id, node_rank, cleared_at, step, phase, open_phases, incident payload]``."""
    if len(record) != 7:
        raise ProtocolError("relayed incident of another shape")
    row_id, node_rank, cleared_at, step, phase, open_phases, report = record
    if not (type(row_id) is int and row_id >= 0 and type(node_rank) is int
            and -1 <= node_rank < MAX_NODES
            and (cleared_at is None or TIME(cleared_at))
            and (step is None or (type(step) is int and step >= 0))
            and (phase is None or isinstance(phase, str)) and isinstance(report, dict)
            and type(open_phases) is list and len(open_phases) <= 64
            and all(isinstance(p, str) for p in open_phases)):
        raise ProtocolError("relayed incident out of range")
    checked = IncidentReport.from_payload(report)
    if checked.rank is None or checked.pid is None:
        raise ProtocolError("relayed incident without its rank")
    shown = tuple(escaped(p)[:64] for p in open_phases)
    return RelayedIncident(row_id, node_rank, cleared_at, step, phase and escaped(phase)[:64],
                           shown, checked)


def _clear(record: list[Any]) -> tuple[int, float]:
    if len(record) != 2 or type(record[0]) is not int or not TIME(record[1]):
        raise ProtocolError("relayed stall end out of range")
    return record[0], float(record[1])


def _rejected(value: Any) -> dict[str, int]:
    if (not isinstance(value, dict) or len(value) > MAX_REJECT_REASONS
            or not all(type(n) is int and n >= 0 and len(k) <= MAX_REASON_CHARS
                       for k, n in value.items())):
        raise ProtocolError("relayed rejections are not counts by reason")
    return {escaped(k)[:MAX_REASON_CHARS]: v for k, v in value.items()}
