"""What a profiler capture says: the operators that cost the suspect rank its time,
against the reference rank over the same steps (offline analysis).

A capture (`traceml.records.Capture`, one row per rank) lists each rank's operators per
step, by operator and input shapes.  Here they are added up per operator name (its
costliest shapes kept to show), and each operator's self time on the suspect is set
against the reference's: the difference, per step, is where the suspect's excess went.
Collectives (c10d, gloo, NCCL, and traceml's DDP wait) are kept apart: on the rank that
waits they grow, and that is the other ranks' lateness, not this rank's work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from traceml.records import Capture
from traceml.wire.captures import is_communication

PHASE_OF = {"compute": "compute", "input": "input", "communication": "communication",
            "wait": "wait", "total": "total"}
"""A finding's phase (`traceml.live.metrics.FINDING_PHASES`) as a step's column."""
BY_TIME = frozenset({"COMMUNICATION_BOUND"})
"""Captures whose operators are listed by the suspect's time, not by the difference."""
HOST_PHASES = frozenset({"input", "wait"})
TOP_OPERATORS = 12  # operators a capture's result lists (by the size of their difference)


@dataclass(frozen=True)
class OperatorLine:
    """One operator on the suspect and on the reference, per captured step."""

    name: str
    communication: bool
    suspect_ms: float  # host self time per step (device self time where the GPU ran it; a
    # collective's whole duration: it runs on its backend's threads)
    suspect_calls: float
    suspect_shapes: str  # the input shapes of its costliest signature
    reference_ms: float | None = None  # None: no reference rank
    reference_calls: float | None = None
    reference_shapes: str | None = None
    part: str = "compute"  # where in the step it ran: compute, input (a DataLoader fetch's
    # range) or optimizer (an optimizer's step or zero_grad)

    @property
    def diff_ms(self) -> float | None:
        return None if self.reference_ms is None else self.suspect_ms - self.reference_ms


@dataclass(frozen=True)
class TraceFile:
    rank: int
    host: str | None
    path: str
    num_bytes: int


@dataclass(frozen=True)
class CaptureResult:
    """One capture: which finding asked, which steps, and the operators' difference."""

    capture_id: str
    trigger: str  # the finding's kind, or "manual"
    label: str
    phase: str | None
    suspect: int
    reference: int | None
    start_after: int  # iterations each rank had ended before the first profiled step
    steps_asked: int
    num_steps: int  # steps profiled on every rank that reported (0: nothing to compare)
    device: bool  # the times are the GPU's (CUDA activities were profiled)
    operators: tuple[OperatorLine, ...]
    compute_diff_ms: float | None  # the compute operators' difference (not those of the
    # input or the optimizer), collectives apart
    communication_diff_ms: float | None  # the collectives' difference
    traces: tuple[TraceFile, ...]
    notes: tuple[str, ...]  # what stopped a rank early, or kept it from capturing
    # The finding's phase in the profiled steps as traceml timed them: the suspect's
    # and the reference's ms per step (None: not known)
    phase_ms: tuple[float | None, float | None] = (None, None)

    @property
    def phase_diff_ms(self) -> float | None:
        """How much longer the finding's phase ran on the suspect in the profiled steps."""
        mine, theirs = self.phase_ms
        return None if mine is None or theirs is None else mine - theirs

    @property
    def complete(self) -> bool:
        """Every rank asked profiled every asked step."""
        return self.num_steps == self.steps_asked and not self.notes


def capture_results(captures: Iterable[Capture]) -> tuple[CaptureResult, ...]:
    """The captures of a run, in the order they were asked."""
    by_id: dict[str, list[Capture]] = {}
    for c in captures:
        by_id.setdefault(c.capture_id, []).append(c)
    return tuple(_result(rows) for rows in by_id.values())


def _result(rows: Sequence[Capture]) -> CaptureResult:
    suspect = next((c for c in rows if c.role == "suspect"), rows[0])
    reference = next((c for c in rows if c.role == "reference"), None)
    notes = []
    for c in rows:
        if c.reported_at is None:
            notes.append(f"r{c.rank} sent no report (it ended, or never reached step "
                         f"{c.start_after})")
        elif c.error:
            notes.append(f"r{c.rank}: {c.error}")
        elif c.cut:
            notes.append(f"r{c.rank}: {c.cut}")
    reported = [c for c in rows if c.reported_at is not None and c.num_steps > 0]
    usable = suspect in reported and (reference is None or reference in reported)
    # GPU time where the GPU ran the step; host time for the input and the host's work
    # between steps, which run on the host whatever the device
    device = (any(o[4] is not None for c in reported for o in c.operators)
              and suspect.phase not in HOST_PHASES)
    operators: tuple[OperatorLine, ...] = ()
    compute = comm = None
    if usable:
        mine = _by_name(suspect, device)
        theirs = _by_name(reference, device) if reference is not None else {}
        lines = [_line(key, mine.get(key), theirs.get(key) if reference else None,
                       reference is not None)
                 for key in {*mine, *theirs}]
        if reference is not None:
            compute = sum(line.diff_ms or 0.0 for line in lines
                          if not line.communication and line.part == "compute")
            comm = sum(line.diff_ms or 0.0 for line in lines if line.communication)
        if reference is not None and suspect.trigger not in BY_TIME:
            # The collectives last: the faster rank waits longer in them (the mirror of
            # the suspect's lateness, not work of its own).
            lines.sort(key=lambda line: (line.communication, -abs(line.diff_ms or 0.0)))
        else:  # every rank waits alike: what the time goes to, not who differs
            lines.sort(key=lambda line: -line.suspect_ms)
        operators = tuple(lines[:TOP_OPERATORS])
    num_steps = min((c.num_steps for c in rows), default=0) if usable else 0
    traces = tuple(TraceFile(c.rank, c.host, c.path, c.trace_bytes)
                   for c in rows if c.path is not None)
    phase = PHASE_OF.get(suspect.phase or "", "total")
    return CaptureResult(
        suspect.capture_id, suspect.trigger, suspect.label, suspect.phase, suspect.rank,
        None if reference is None else reference.rank, suspect.start_after,
        suspect.steps_asked, num_steps, device, operators, compute, comm, traces, tuple(notes),
        (_step_ms(suspect, phase), None if reference is None else _step_ms(reference, phase)))


def _step_ms(c: Capture, phase: str) -> float | None:
    return dict(c.step_ms).get(phase)


def _by_name(c: Capture, device: bool) -> dict[tuple[str, str], tuple[float, float, str]]:
    """Per (operator name, part of the step): (ms per step, calls per step, its
    costliest shapes)."""
    out: dict[tuple[str, str], tuple[float, float, str, float]] = {}
    for name, shapes, calls, self_ms, device_ms, part in c.operators:
        ms = (device_ms or 0.0) if device else self_ms
        total, n, best, best_ms = out.get((name, part), (0.0, 0.0, "", -1.0))
        if ms > best_ms:
            best, best_ms = shapes, ms
        out[(name, part)] = (total + ms, n + calls, best, best_ms)
    return {key: (v[0], v[1], v[2]) for key, v in out.items()}


def _line(key: tuple[str, str], mine: tuple[float, float, str] | None,
          theirs: tuple[float, float, str] | None, has_reference: bool) -> OperatorLine:
    name, part = key
    ms, calls, shapes = mine or (0.0, 0.0, "")
    if not has_reference:
        return OperatorLine(name, is_communication(name), ms, calls, shapes, part=part)
    ref_ms, ref_calls, ref_shapes = theirs or (0.0, 0.0, "")
    return OperatorLine(name, is_communication(name), ms, calls, shapes,
                        ref_ms, ref_calls, ref_shapes, part)
