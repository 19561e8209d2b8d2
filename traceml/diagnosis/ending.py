"""How the run ended, said first: stalled, crashed, or before the first step (rules;
their findings are phrased in `traceml.diagnosis.ending_text`).

Runs in the offline-analysis process and in the live views.  Reads the stalls
and crashes the collector stored (`Incident`), the run's exit status and the
system samples:

* **STALLED** (crit): a rank made no progress past the stall threshold and the
  run was stopped (or, live, is still stuck).  The culprit is the stalled rank
  that is *not* inside a collective: the others wait for it in theirs.  When
  every stalled rank is inside a collective, no stack can name one culprit:
  the first rank to stop is named, and the finding says why it may not be the
  cause (a collective called by some ranks only, or in another order).
* **CRASHED** (crit): a rank died of an exception (type, message, the user's
  frame), of a signal (its faulthandler stack; for SIGKILL the host's memory
  at that moment, since the kernel's out-of-memory killer sends it), or of
  CUDA's out-of-memory error (allocated, reserved and capacity then).
  **FAILED** (crit): it exited non-zero without either.  The first to fail is
  the culprit; those that failed after it are named as following it.
* **ENDED BEFORE THE FIRST STEP**: nothing trained, and nothing above says why.
* **STALL CLEARED** (warn): a stall that ended because steps resumed, with
  its duration; **NO PROGRESS BEFORE EXIT** (info): no progress since the last
  event until a clean exit (a final checkpoint, say), which is not a hang.

A rank stalled outside every collective before the first crash is the cause
of the run's end (a collective timeout raising on the waiting ranks follows
it): STALLED wins then.  Ranks left waiting in a collective for a rank that
crashed are that crash's consequence: CRASHED, and they are named as waiting.
Ctrl-C's KeyboardInterrupt and the launcher's SIGTERM to the other ranks are
how a run is stopped, not crashes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from traceml import phases
from traceml.diagnosis.ending_text import (
    cleared_finding,
    crash_finding,
    crash_not_confirmed,
    ended_before_first_step,
    idle_finding,
    launcher_lost_finding,
    stall_roles,
    stalled_finding,
)
from traceml.diagnosis.finding import Finding
from traceml.records import Incident, RunData, rank_totals

STOPPING_EXCEPTIONS = frozenset({"KeyboardInterrupt", "SystemExit"})
STOPPING_SIGNALS = frozenset({"SIGINT", "SIGTERM", "SIGHUP"})

STATES = ("running", "completed", "interrupted", "stalled", "crashed", "failed", "no_steps",
          "launcher_lost")
_HEADLINED = frozenset({"stalled", "crashed", "failed", "no_steps", "launcher_lost"})
_COLLECTIVE = frozenset(p.name for p in phases.PHASES if p.collective)


@dataclass(frozen=True)
class Ending:
    """How the run ended: its state, the findings that say so (the headline first
    when the state has one) and the incidents behind them."""

    state: str  # one of STATES
    findings: tuple[Finding, ...]
    incidents: tuple[Incident, ...]
    culprits: tuple[int, ...] = ()  # ranks named as the cause

    @property
    def headline(self) -> Finding | None:
        """The finding the run's verdict shows before every section's."""
        return self.findings[0] if self.state in _HEADLINED and self.findings else None


def diagnose_ending(run: RunData) -> Ending:
    """The run's ending from its incidents and exit status."""
    meta = run.meta
    ending = _ending(run)
    if not meta.lost:
        return ending
    # No end will be recorded: a stall or crash found before stays the verdict (a hung job
    # is often killed so), with the lost launcher beside it; otherwise it is the verdict.
    lost = launcher_lost_finding(run)
    if ending.state in ("stalled", "crashed", "failed"):
        return dataclasses.replace(ending, findings=(*ending.findings, lost))
    return Ending("launcher_lost", (lost, *ending.findings), ending.incidents, ending.culprits)


def _ending(run: RunData) -> Ending:
    meta = run.meta
    running = meta.exit_code is None
    stalls = [i for i in run.incidents if i.what == "stall"]
    active = _latest_per_rank(s for s in stalls if s.cleared_at is None)
    crashes = _crashes(run.incidents)
    end = meta.ended_at if not running else max(
        (i.detected_at for i in run.incidents), default=meta.started_at)
    findings: list[Finding] = []
    culprits: tuple[int, ...] = ()
    if active and (running or meta.exit_code != 0) and stall_caused_it(active, crashes):
        state = "stalled"
        finding = stalled_finding(active, run, end, crashes)
        findings.append(finding)
        culprits = finding.ranks
    elif crashes and meta.exit_code != 0:  # the launcher's exit status decides, not a message
        finding = crash_finding(crashes, run, active)
        state = "failed" if finding.kind == "FAILED" else "crashed"
        findings.append(finding)
        culprits = finding.ranks
    elif not running and meta.mode == "run" and not rank_totals(run):
        state = "no_steps"
        findings.append(ended_before_first_step(meta.exit_code))
    elif not running and meta.exit_code is not None and meta.exit_code > 128:
        state = "interrupted"
    else:
        state = "running" if running else "completed"
    if crashes and meta.exit_code == 0:
        findings.append(crash_not_confirmed(crashes))
    cleared = [s for s in stalls if s.cleared_at is not None]
    if cleared:
        findings.append(cleared_finding(cleared, stalls, run))
    if active and state not in ("stalled", "running"):
        quiet = [s for s in active if s.rank not in culprits]
        if quiet and state == "completed":
            findings.append(idle_finding(quiet, end))
    return Ending(state, tuple(findings), tuple(run.incidents), culprits)


def stall_caused_it(active: Sequence[Incident], crashes: Sequence[Incident]) -> bool:
    """Whether the open stalls, not a crash, explain the run's end: a rank stalled
    outside every collective before the first crash; or every stalled rank waits in
    one and the first crash is one of them (its collective timed out).  Ranks left
    waiting for a rank that crashed are that crash's consequence."""
    if not crashes:
        return True
    first = crashes[0]
    culprits, _ = stall_roles(active)
    if culprits:
        return min(s.began_at for s in culprits) <= first.began_at
    return (first.rank in {s.rank for s in active}
            and min(s.began_at for s in active) <= first.began_at)


def _latest_per_rank(incidents: Iterable[Incident]) -> list[Incident]:
    latest: dict[int, Incident] = {}
    for i in incidents:
        if i.rank not in latest or i.began_at >= latest[i.rank].began_at:
            latest[i.rank] = i
    return [latest[r] for r in sorted(latest)]


# -- stalls and crashes -------------------------------------------------------------------


def _crashes(incidents: Sequence[Incident]) -> list[Incident]:
    """One incident per rank that died, the exception and the launcher's exit record
    merged (the exception's stack, step and phase; the exit's status), by time."""
    by_rank: dict[int, Incident] = {}
    exits: dict[int, Incident] = {}
    for i in incidents:
        if i.what == "exception" and str(i.detail.get("type")) not in STOPPING_EXCEPTIONS:
            by_rank.setdefault(i.rank, i)
        elif i.what == "exit" and _is_crash_exit(i):
            exits.setdefault(i.rank, i)
    for rank, exit_record in exits.items():
        if rank in by_rank:
            exc = by_rank[rank]
            by_rank[rank] = dataclasses.replace(exc, detail={**exit_record.detail, **exc.detail})
        else:
            by_rank[rank] = exit_record
    return sorted(by_rank.values(), key=lambda i: i.began_at)


def _is_crash_exit(i: Incident) -> bool:
    sig = i.detail.get("signal")
    code = i.detail.get("exit_code")
    if sig is not None:
        return str(sig) not in STOPPING_SIGNALS
    return isinstance(code, int) and code not in (0, 130, 143)
