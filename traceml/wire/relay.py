"""A node's relay batch to node 0's collector (wire: `traceml.collector.relay` builds
it, node 0 takes it from the relays' key alone).

One message per relay flush: the states of the node's senders (an identity and
`RELAY_STATE_FIELDS` each), their steps (a block per sender's run of steps, as node 0
stores it: the relay's node regroups, sums and encodes them, not node 0), FLOP counts
``[index, time, *FLOP_COUNT_FIELDS]``, process and system samples by sender index,
incidents the relay placed at the rank's step (`RelayedIncident`), stalls that
cleared (``(id, at)``) and the relay's rejections by reason.  Decoding checks every
value as the kind's own decode would, except the step blocks: their shape here,
their headers where node 0 stores them, their rows' values where the store is read
(the relay checked the events they came from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from traceml import phases, step_fields
from traceml.errors import ProtocolError
from traceml.wire.checks import TIME, escaped, lists, records
from traceml.wire.events import FLOP_COUNT_CHECKS
from traceml.wire.identity import MAX_NODES, NUM_SENDER_VALUES, Sender, sender_from
from traceml.wire.incidents import IncidentReport
from traceml.wire.rows import ProcessRows, SystemRows

RELAY_STATE_FIELDS = ("first_seen", "last_seen", "num_messages", "num_gaps", "last_seq",
                      "num_sent", "num_dropped", "said_bye")
MAX_RELAYED_SENDERS = 4096
MAX_RELAYED_BLOCKS = 1 << 16  # step blocks in one batch (a node's ranks over one flush)
MAX_REJECT_REASONS = 64
MAX_REASON_CHARS = 200

BLOCK_COLUMNS = [f.name for f in step_fields.measured()]
"""The columns of a relayed block's rows, in order."""
BLOCK_LENGTH = 3 + (len(phases.PHASES) + 2) + 1 + 2 + 1
"""A block's values after its sender index (`traceml.store.step_block`): first and last
step, count, the sums (`traceml.store.schema.BLOCK_SUMMED`: each phase, total and wait;
and the evaluation passes' time), passes, CUDA steps, rows."""


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
    # Each sender's steps as the blocks node 0 stores (`traceml.store.step_block`, made
    # here on the relay's node): [sender index, first, last, count, *sums, passes, CUDA
    # steps, rows as JSON text]; the rows' columns are `block_columns`.
    step_blocks: list[list[Any]]
    flop_counts: list[list[Any]]  # [sender index, time, *FLOP_COUNT_FIELDS]
    process: list[tuple[int, ProcessRows]]
    system: list[tuple[int, SystemRows]]
    incidents: list[RelayedIncident]
    clears: list[tuple[int, float]]  # (row id, when the stall ended)
    rejected: dict[str, int]

    def payload(self) -> dict[str, Any]:
        return {"senders": [[*s.values(), *state] for s, state in self.senders],
                "blocks": self.step_blocks, "block_columns": list(BLOCK_COLUMNS),
                "flops": self.flop_counts,
                "process": [[i, rows.payload()] for i, rows in self.process],
                "system": [[i, rows.payload()] for i, rows in self.system],
                "incidents": [i.values() for i in self.incidents],
                "clears": [list(c) for c in self.clears], "rejected": self.rejected}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> RelayBatch:
        """A relay payload, checked whole; ProtocolError for anything else."""
        senders = _senders(payload.get("senders"))
        n = len(senders)
        parts: list[Any] = [payload.get(k) for k in ("blocks", "flops", "process", "system",
                                                     "incidents", "clears")]
        if not all(lists(p) for p in parts):
            raise ProtocolError("relayed records are not lists")
        blocks, flops, process, system, incidents, clears = parts
        _step_blocks(blocks, payload.get("block_columns"), n)
        if (not all(len(r) == 2 and isinstance(r[1], dict) for r in [*process, *system])
                or not all(flops) or not records([r[1:] for r in flops], FLOP_COUNT_CHECKS)):
            raise ProtocolError("relayed records are not lists of their shape")
        if not all(type(r[0]) is int and 0 <= r[0] < n for r in [*flops, *process, *system]):
            raise ProtocolError("relayed record of no relayed sender")
        return cls(senders, blocks, flops,
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


def _step_blocks(blocks: list[list[Any]], columns: Any, num_senders: int) -> None:
    """Relayed step blocks: each of a relayed sender, with its rows as text, in the
    columns this version's rows have (a relay of another version would store its rows
    under another layout).  Their headers are checked where they are stored (the
    writer refuses one that `traceml.store.step_block` would not make), their rows'
    values where the store is read, as every stored row's."""
    if not blocks:
        return
    if columns != BLOCK_COLUMNS:
        raise ProtocolError("relayed steps in other columns than this traceml's (a relay "
                            "of another version)")
    if len(blocks) > MAX_RELAYED_BLOCKS or not all(len(b) == 1 + BLOCK_LENGTH for b in blocks):
        raise ProtocolError("relayed step blocks are not blocks")
    if not all(type(b[0]) is int and 0 <= b[0] < num_senders and type(b[-1]) is str
               for b in blocks):
        raise ProtocolError("relayed step block of no relayed sender, or without rows")
    if len({b[0] for b in blocks}) != len(blocks):  # a relay makes one a sender
        raise ProtocolError("two relayed step blocks of one sender")


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
