"""What the collector does with each accepted message (collector side): the
sender's state and what it may speak for, then its steps, samples and incidents
into the store.

`Collector` is the intake of node 0's collector and of every node's relay alike
(`traceml.collector.server` runs it over its sockets; a relay over an outbox,
`traceml.collector.relay`).  A sender is claimed once: a replay, or a sender
speaking for a rank (or node) another sender owns, is rejected and counted by
reason; so is a control message from anyone but the launcher's key, and a relay
batch from anyone but the relays' key.  Per-sender sequence gaps are counted.
A relay's batch carries its senders' states and their step rows, samples and
incidents: each of its senders is claimed here as if it had spoken.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

from traceml import phases, stacks, step_fields
from traceml.clocks import Exchange
from traceml.collector import intake
from traceml.collector.config import CollectorConfig
from traceml.collector.intake import Rejected
from traceml.collector.rank_steps import RankSteps
from traceml.errors import ProtocolError
from traceml.records import Capture, FlopCount, Incident, StepRow
from traceml.security import NODE_ROLES, TokenBook
from traceml.store import JoinError, SenderState, StoreError, relayed_rows
from traceml.wire.captures import CaptureReport
from traceml.wire.envelope import Envelope
from traceml.wire.events import EventBatch
from traceml.wire.identity import Sender, sender_from
from traceml.wire.incidents import RESUMED, STALL, IncidentReport
from traceml.wire.records import Bye, Control, Hello, RunEnd, RunStart, StopCollector
from traceml.wire.relay import RelayBatch, RelayedIncident
from traceml.wire.rows import ProcessRows, SystemRows

MAX_SENDERS = 1 << 16
BAD_STEPS = "step with a bad step index or time"
"""The rejection reason of steps no block can hold (a relay counts its own the same)."""


class Store(Protocol):
    """Where the collector puts what it accepted: the SQLite store on node 0
    (`StoreWriter`), or a relay's batch to node 0 (`traceml.collector.relay.Outbox`)."""

    num_bad_steps: int  # steps refused so far: a step index or summed time out of bounds
    def add_steps(self, rows: Sequence[StepRow]) -> int: ...
    def add_relayed_blocks(self, blocks: Iterable[tuple[tuple[int, int, int], Sequence[Any]]]
                           ) -> int: ...
    def add_flop_counts(self, sender: Sender, counts: Iterable[FlopCount]) -> None: ...
    def add_process(self, sender: Sender, samples: ProcessRows) -> None: ...
    def add_processes(self, samples: Iterable[tuple[Sender, ProcessRows]]) -> None: ...
    def add_system(self, sender: Sender, samples: SystemRows) -> None: ...
    def add_incident(self, i: Incident) -> int: ...
    def add_capture_ask(self, c: Capture) -> None: ...
    def add_capture_report(self, rank: int, host: str, report: CaptureReport) -> bool: ...
    def clear_stall(self, row_id: int, cleared_at: float) -> None: ...
    def save_sender(self, s: SenderState) -> None: ...
    def save_senders(self, states: Iterable[SenderState]) -> None: ...
    def save_rejected(self, counts: Mapping[str, int]) -> None: ...
    def save_run(self, record: RunStart | RunEnd) -> None: ...
    def add_clock_exchange(self, host: str, pid: int, exchange: Exchange) -> None: ...
    def save_clock_reference(self, host: str, pid: int) -> None: ...
    def add_join_error(self, error: JoinError) -> None: ...
    def save_launcher_lost(self, at: float, role: str) -> None: ...
    def save_exports(self, exports: Mapping[str, Mapping[str, Any]]) -> None: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


class Collector:
    """Receives envelopes and writes them to the store."""

    def __init__(self, config: CollectorConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.senders: dict[str, SenderState] = {}
        self.rank_steps: dict[str, RankSteps] = {}  # sender id -> its step tracker
        self.owners: dict[tuple[Any, ...], tuple[str, int]] = {}  # who speaks for what
        self.rejected: dict[str, int] = {}
        self.open_stalls: dict[tuple[int, int], int] = {}  # (rank, pid) -> its stall's row
        self.ended = False
        self.max_world_size = 0  # the launcher's RunStart says (0: not known yet)
        self.store_failed = False
        self.num_steps = 0
        self.relayed_by: dict[str, str] = {}  # sender id -> the relay that speaks for it
        # rank -> its rank senders (one per attempt), by id: incidents ask it of each rank
        self.rank_senders: dict[int, dict[str, Sender]] = {}
        self.relayed_rows: dict[tuple[str, int], int] = {}  # (relay, its stall id) -> row
        # relay process (host, pid: its id changes when a c10d relay learns its node) ->
        # the running totals of what it rejected
        self.relayed_rejected: dict[tuple[str, int], dict[str, int]] = {}
        self._prefix = intake.session_prefix(config.session_id)
        self._tokens = (TokenBook(config.secret, config.session_id)
                        if config.tokens and config.secret else None)
        self._budgets = ByteBudgets()

    def handle(self, data: bytes, from_launcher: bool = False, from_relay: bool = False) -> None:
        """One message; ``from_launcher`` / ``from_relay``: it came with the
        launcher's key / the relays' key."""
        try:
            env = intake.accept(data, self._prefix, self.config.max_message_bytes, self._meter)
            self._dispatch(env, from_launcher, from_relay)
        except Rejected as exc:
            self.reject(exc.reason)
        except (ProtocolError, ValueError, TypeError, KeyError, ArithmeticError):
            self.reject("a payload that cannot be replayed or stored")
        except StoreError:
            self.store_failed = True
            self.reject("not stored: the store failed")

    def is_local_rank(self, rank: int) -> bool:
        """Whether ``rank`` sends here itself, not through a node's relay (any thread:
        a read of the dicts the loop changes; False when one changed under it)."""
        try:
            return any(sid not in self.relayed_by for sid in list(self.rank_senders.get(rank, ())))
        except RuntimeError:
            return False

    def launcher_lost(self, at: float, role: str) -> None:
        """Record that the launcher (``role``: or the training process, under
        traceml.init()) vanished before telling the run's end."""
        try:
            self.store.save_launcher_lost(at, role)
        except StoreError:
            self.store_failed = True

    def save_clock_reference(self, host: str, pid: int) -> None:
        """Record the launcher whose node the other nodes' clocks are set against."""
        try:
            self.store.save_clock_reference(host, pid)
        except StoreError:
            self.store_failed = True

    def save_exports(self, exports: Mapping[str, Mapping[str, Any]]) -> None:
        """Record how the metrics exports went (``{"otlp": {"sent": .., "failed": ..}}``)."""
        try:
            self.store.save_exports(exports)
        except StoreError:
            self.store_failed = True

    def all_said_bye(self) -> bool:
        """Every sender that spoke has said goodbye: nothing more is in flight."""
        return all(state.said_bye for state in self.senders.values())

    def reject(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.rejected[reason] = self.rejected.get(reason, 0) + n

    def _state(self, env: Envelope) -> SenderState:
        """The sender's state; Rejected for a replay, or a sender speaking for
        a rank (or node) that another sender already spoke for."""
        key = env.sender.sender_id
        state = self.senders.get(key)
        if state is not None:
            if env.seq <= state.last_seq:
                raise Rejected("replayed or duplicate message")
            return state
        if len(self.senders) >= MAX_SENDERS:
            raise Rejected("too many senders")
        if self.max_world_size and not _within(env.sender, self.max_world_size):
            raise Rejected("rank or world size beyond what the launcher starts")
        claim = _claim(env.sender)
        owner = (env.sender.host, env.sender.pid)
        if claim is not None and self.owners.setdefault(claim, owner) != owner:
            raise Rejected("rank or node claimed by another sender")
        now = time.time()
        state = self.senders[key] = SenderState(env.sender, now, now)
        self._index(env.sender)
        return state

    def _track(self, state: SenderState, env: Envelope) -> None:
        if env.seq > state.last_seq + 1:
            state.num_gaps += env.seq - state.last_seq - 1
        state.last_seq = env.seq
        state.last_seen = time.time()
        state.num_messages += 1
        state.num_sent = max(state.num_sent, env.num_sent + 1)
        state.num_dropped = max(state.num_dropped, env.num_dropped)

    def _meter(self, parsed: dict[str, Any], size: int) -> bool:
        """Whether a parsed message's sender may spend ``size`` more bytes now, asked
        before it is decoded.  With tokens, the token is checked against the identity
        the message claims first (one HMAC): one without its identity's token is
        refused here, undecoded, and the budgets are kept per proven rank token; the
        launcher's processes (the node token: samplers, relays, the launcher) are the
        job's own, not metered.  Without tokens (Ray's workers), per claimed identity.
        A message whose identity cannot be read shares one budget (decode refuses it)."""
        try:
            sender = sender_from(parsed.get("from"))
        except (TypeError, ValueError):
            return self._budgets.spend("", size)
        if self._tokens is None:
            return self._budgets.spend(repr(_claim(sender) or sender.sender_id), size)
        token = parsed.get("tok")
        if not self._proves(sender, token):
            raise Rejected("sender without the token of its identity")
        return sender.role in NODE_ROLES or self._budgets.spend(str(token), size)

    def _proves(self, sender: Sender, token: Any) -> bool:
        """Whether ``token`` is the token of ``sender``'s identity (constant time)."""
        assert self._tokens is not None
        expected = self._tokens.of(sender.role, sender.rank, sender.restart)
        return (expected is not None and type(token) is str and token.isascii()
                and hmac.compare_digest(token, expected))

    def _dispatch(self, env: Envelope, from_launcher: bool, from_relay: bool = False) -> None:
        # The sender's token was checked against its identity before decoding (`_meter`).
        message = env.message
        if isinstance(message, (RunStart, RunEnd, StopCollector)):
            if not from_launcher:
                raise Rejected("control message from a sender other than the launcher")
            self._control(message)
            return
        if isinstance(message, RelayBatch) and not (from_relay and env.sender.role == "relay"):
            raise Rejected("relay batch from a sender other than a relay")
        state = self._state(env)
        match message:
            case RelayBatch():
                self._relayed(env.sender, message)
            case EventBatch():
                self._add_steps(env.sender, message)
            case ProcessRows():
                self.store.add_process(env.sender, message)
            case SystemRows():
                self.store.add_system(env.sender, message)
            case IncidentReport():
                self._incident(env.sender, message)
            case CaptureReport():
                if env.sender.role != "rank" or env.sender.rank is None or not (
                        self.store.add_capture_report(env.sender.rank, env.sender.host, message)):
                    raise Rejected("capture report without its ask")
            case Bye():
                state.said_bye = True
                self.rank_steps.pop(state.sender.sender_id, None)  # its last events came before
            case Hello():
                pass
        self._track(state, env)
        self.store.save_sender(state)

    def _incident(self, sender: Sender, report: IncidentReport) -> None:
        """A stall or crash, placed at the rank's step and phase: from its step
        tracker (a rank's own stall report comes after all its events) or, for a
        stack taken from outside or an exception's traceback, from the stack."""
        rank = sender.rank if sender.role == "rank" else report.rank
        pid = sender.pid if sender.role == "rank" else report.pid
        if rank is None or pid is None or sender.role not in ("rank", "system"):
            raise Rejected("incident without its rank")
        who = sender if sender.role == "rank" else self._rank_sender(rank, pid) or sender
        if who.host != sender.host:  # a node's launcher speaks for its own ranks only
            raise Rejected("incident about a rank of another node")
        key = (rank, pid)
        if report.what == RESUMED:
            row = self.open_stalls.pop(key, None)
            if row is not None:
                self.store.clear_stall(row, report.at)
                return
        elif report.what == STALL and key in self.open_stalls:
            return  # already reported (by the rank, or from outside)
        steps = self.rank_steps.get(who.sender_id)
        step, codes = steps.tracker.position() if steps is not None else (None, ())
        open_phases = tuple(phases.PHASES[c].name for c in codes if c < len(phases.PHASES))
        phase = open_phases[-1] if open_phases else None
        if report.what == STALL and who is sender:  # every event came before
            phase = phase or stacks.phase_of(report.stack)
        elif report.stack:  # taken now, while the events may lag: the stack says
            phase = stacks.phase_of(report.stack)
        what = STALL if report.what == RESUMED else report.what
        row = self.store.add_incident(Incident(
            what=what, rank=rank, node_rank=who.node_rank, host=who.host, pid=pid,
            began_at=report.began_at, detected_at=time.time(),
            cleared_at=report.at if report.what == RESUMED else None,
            step=step, phase=phase, open_phases=open_phases, stack=report.stack,
            stack_source=report.stack_source, detail=report.detail))
        if report.what == STALL:
            self.open_stalls[key] = row

    def _index(self, sender: Sender) -> None:
        if sender.role == "rank" and sender.rank is not None:
            self.rank_senders.setdefault(sender.rank, {})[sender.sender_id] = sender

    def _rank_sender(self, rank: int, pid: int) -> Sender | None:
        return next((s for s in self.rank_senders.get(rank, {}).values() if s.pid == pid), None)

    def _add_steps(self, sender: Sender, batch: EventBatch) -> None:
        steps = self.rank_steps.get(sender.sender_id)
        if steps is None:
            steps = self.rank_steps[sender.sender_id] = RankSteps(sender)
        records = steps.feed_batch(batch)
        if steps.flop_counts:
            self.store.add_flop_counts(sender, steps.flop_counts)
            steps.flop_counts = []
        plausible = [r for r in records if _plausible(r)]
        self.reject("implausible step times", len(records) - len(plausible))
        self._count_stored(len(plausible), lambda: self.store.add_steps(plausible),
                           BAD_STEPS)

    def _relayed(self, relay: Sender, batch: RelayBatch) -> None:
        """A node's relay's batch: its senders' states (each claims its rank as if it
        spoke here), then their steps, samples, FLOP counts and incidents."""
        now = time.time()
        senders = [self._relayed_sender(relay, who, values, now) for who, values in batch.senders]
        self.store.save_senders(self.senders[s.sender_id] for s in senders if s is not None)
        self._relayed_steps(batch.step_blocks, senders)
        for i, *count in batch.flop_counts:
            if senders[i] is not None:
                self.store.add_flop_counts(senders[i], [FlopCount(*count)])
        self.store.add_processes([(who, process) for i, process in batch.process
                                  if (who := senders[i]) is not None])
        for i, system in batch.system:
            if (who := senders[i]) is not None:
                self.store.add_system(who, system)
        for relayed in batch.incidents:
            self._relayed_incident(relay, relayed)
        for row_id, at in batch.clears:
            if (relay.sender_id, row_id) in self.relayed_rows:
                self.store.clear_stall(self.relayed_rows.pop((relay.sender_id, row_id)), at)
        self.relayed_rejected[(relay.host, relay.pid)] = batch.rejected

    def _relayed_incident(self, relay: Sender, relayed: RelayedIncident) -> None:
        r = relayed.report
        speaker = self._relayed_rank(relay, r.rank, r.pid)
        if speaker is False:
            self.reject("incident about a rank of another node")
            return
        assert r.rank is not None and r.pid is not None  # the relay batch's decode checked
        node_rank = relayed.node_rank if speaker is None else speaker.node_rank
        row = self.store.add_incident(Incident(
            what=r.what, rank=r.rank, node_rank=node_rank, host=relay.host, pid=r.pid,
            began_at=r.began_at, detected_at=r.at, cleared_at=relayed.cleared_at,
            step=relayed.step, phase=relayed.phase, open_phases=relayed.open_phases,
            stack=r.stack, stack_source=r.stack_source, detail=r.detail))
        if r.what == STALL and relayed.cleared_at is None:
            self.relayed_rows[(relay.sender_id, relayed.row_id)] = row

    def _relayed_rank(self, relay: Sender, rank: int | None,
                      pid: int | None) -> Sender | None | Literal[False]:
        """The sender of the rank a relayed incident is about: False when that rank
        speaks here directly or through another relay (a relay speaks for its own
        node's ranks only); None when the rank never spoke (it crashed first)."""
        known = list(self.rank_senders.get(rank, {}).values()) if rank is not None else []
        if any(self.relayed_by.get(s.sender_id) != relay.sender_id for s in known):
            return False
        return next((s for s in known if s.pid == pid), None)

    def _relayed_sender(self, relay: Sender, who: Sender, values: list[Any],
                        now: float) -> Sender | None:
        """A relayed sender's state, stored as seen now; None: refused (another node's
        sender, or a rank another sender or relay speaks for)."""
        key = who.sender_id
        if who.host != relay.host or who.role == "relay":
            self.reject("relayed sender of another node")
            return None
        if key in self.senders:
            if self.relayed_by.get(key) != relay.sender_id:
                self.reject("rank or node claimed by another sender")
                return None
        elif len(self.senders) >= MAX_SENDERS:
            self.reject("too many senders")
            return None
        elif self.max_world_size and not _within(who, self.max_world_size):
            self.reject("rank or world size beyond what the launcher starts")
            return None
        else:
            claim = _claim(who)
            if claim is not None and self.owners.setdefault(claim, (who.host, who.pid)) != (
                    who.host, who.pid):
                self.reject("rank or node claimed by another sender")
                return None
        state = self.senders[key] = SenderState(who, *values)
        state.last_seen = now  # node 0's clock: its silence watch compares with it
        self.relayed_by[key] = relay.sender_id
        self._index(who)
        return who

    def _relayed_steps(self, blocks: list[list[Any]], senders: list[Sender | None]) -> None:
        if not blocks:
            return
        prefixes = [None if s is None or s.rank is None else (s.rank, s.restart, s.node_rank)
                    for s in senders]
        kept = [(prefix, b[1:]) for b in blocks if (prefix := prefixes[b[0]]) is not None]
        refused = sum(relayed_rows(b[1:]) for b in blocks if prefixes[b[0]] is None)
        self.reject("relayed step of a refused sender", refused)
        offered = sum(relayed_rows(b) for _, b in kept)
        self._count_stored(offered, lambda: self.store.add_relayed_blocks(kept),
                           "relayed step with a bad step index or time")

    def _count_stored(self, offered: int, store: Callable[[], int], bad_reason: str) -> None:
        """Store ``offered`` steps with ``store``; count those stored, those the store
        refused (``bad_reason``) and the rest, duplicates."""
        bad_before = self.store.num_bad_steps
        stored = store()
        bad = self.store.num_bad_steps - bad_before
        self.reject(bad_reason, bad)
        self.reject("duplicate step", offered - bad - stored)
        self.num_steps += stored

    def all_rejected(self) -> dict[str, int]:
        """What this collector rejected, and what every relay reported it rejected."""
        total = dict(self.rejected)
        for counts in self.relayed_rejected.values():
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def _control(self, record: Control) -> None:
        if isinstance(record, RunStart) and record.session_id != self.config.session_id:
            raise Rejected("run start of another session")
        if isinstance(record, RunStart):
            self.max_world_size = record.max_world_size
        if isinstance(record, (RunStart, RunEnd)):
            self.store.save_run(record)
        else:
            self.ended = True

    def flush(self) -> None:
        """Commit what was stored; a store that cannot be written (a full disk)
        is remembered, and the run goes on."""
        try:
            rejected = self.all_rejected()
            if rejected:
                self.store.save_rejected(rejected)
            self.store.commit()
        except StoreError:
            self.store_failed = True

    def close(self) -> None:
        try:
            self.store.close()
        except StoreError:
            self.store_failed = True


SENDER_BYTES_PER_S = 4 << 20
"""What one rank or node sampler may send, on average (a fast rank sends a few hundred
KiB/s); more is refused and counted, so a key holder's flood of large valid messages
cannot take the collector's time from the others."""
SENDER_BURST_BYTES = 32 << 20  # ...and at once (four messages of the largest size)
MAX_BUDGETS = 1 << 17  # tokens with a budget of their own (a job's ranks and attempts)


class ByteBudgets:
    """Per token, a bucket of bytes (`SENDER_BYTES_PER_S`, `SENDER_BURST_BYTES`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._left: dict[str, tuple[float, float]] = {}  # token -> (bytes left, when)

    def spend(self, key: str, size: int) -> bool:
        """Whether ``key``'s sender may send ``size`` bytes now (then they are spent)."""
        if len(self._left) >= MAX_BUDGETS and key not in self._left:
            key = ""  # made-up tokens share one budget
        now = self.clock()
        left, at = self._left.get(key, (float(SENDER_BURST_BYTES), now))
        left = min(float(SENDER_BURST_BYTES), left + (now - at) * SENDER_BYTES_PER_S)
        if size > left:
            self._left[key] = (left, now)
            return False
        self._left[key] = (left - size, now)
        return True


def _plausible(row: StepRow) -> bool:
    """Values a step can have (`traceml.step_fields`): times finite, not negative, under
    `step_fields.MAX_STEP_MS`; counts and sizes in range."""
    return all(map(step_fields.admits, step_fields.STEP_FIELDS, row))


def _within(sender: Sender, max_world_size: int) -> bool:
    """Whether a sender's rank and world size are ones the launcher can start."""
    return ((sender.rank is None or sender.rank < max_world_size)
            and (sender.world_size is None or sender.world_size <= max_world_size))


def _claim(sender: Sender) -> tuple[Any, ...] | None:
    """What a sender speaks for, that no other sender may: its rank in its
    attempt, or its node's system samples (None: nothing exclusive)."""
    if sender.rank is not None:
        return ("rank", sender.rank, sender.restart)
    if sender.role == "system" and sender.node_rank >= 0:
        return ("system", sender.node_rank)
    return None
