"""The ending's findings, phrased (offline analysis and the live views): STALLED,
CRASHED or FAILED, ENDED BEFORE THE FIRST STEP, STALL CLEARED, NO PROGRESS BEFORE EXIT,
CRASH NOT CONFIRMED and LAUNCHER LOST, each with its numbers; `traceml.diagnosis.ending`
decides which the run gets.  A sentence about many ranks says what they share once
(`said_of_ranks`), so a job-wide stall at 8192 ranks reads as one clause."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from traceml import phases, stacks
from traceml.diagnosis.finding import Finding, format_bytes, format_ranks
from traceml.diagnosis.thresholds import RAM_LOOKBACK_S
from traceml.records import Incident, RunData, rank_totals

OOM_KILLER_RAM_PCT = 90.0
"""Host memory (%) at a SIGKILL above which the kernel's OOM killer is the likely sender."""
_COLLECTIVE = frozenset(p.name for p in phases.PHASES if p.collective)
_LABELS = {p.name: p.label.lower() for p in phases.PHASES}  # "in comm hook", "in forward"


def waiting(stall: Incident) -> bool:
    """Whether a stalled rank stands inside a collective: it waits for the others."""
    return stall.phase in _COLLECTIVE or stacks.phase_of(stall.stack) in _COLLECTIVE


def stall_roles(stalled: Sequence[Incident]) -> tuple[list[Incident], list[Incident]]:
    """The stalled ranks not inside a collective (the culprits) and those waiting in one."""
    culprits = [s for s in stalled if not waiting(s)]
    return culprits, [s for s in stalled if waiting(s)]


def where_phase(i: Incident) -> str:
    """``in forward``, ``outside every phase``, ``in communication (backward's gradient
    all-reduce)``."""
    if i.phase is None:
        return "outside every phase"
    name = _LABELS.get(i.phase, i.phase)
    if i.phase in _COLLECTIVE and "backward" in i.open_phases:
        return f"in {name} (backward's gradient all-reduce)"
    return f"in {name}"


def _at_step(i: Incident, run: RunData) -> str:
    if i.step is None:
        return ""
    if i.step == 0 and i.rank not in rank_totals(run):
        return " before any step of it was recorded"
    return f" at step {i.step}"


def _where(i: Incident) -> str:
    if not i.stack:
        return "its stack could not be taken"
    return stacks.where(i.stack)


def _rank(i: Incident) -> str:
    """``r1 (n0)``: the rank and its node."""
    return f"r{i.rank} (n{i.node_rank})"


RANKS_NAMED = 8
"""Ranks a sentence names before ``+N more`` (the JSON's incidents keep them all)."""
GROUPS_SAID = 3
"""Distinct clauses a sentence says before counting the remaining ranks."""


NODES_NAMED = 4
"""Nodes a merged clause names (``(n0, n1)``) before it counts them (``(on 1024 nodes)``)."""


def said_of_ranks(incidents: Sequence[Incident], say: Callable[[Incident], str],
                  rest: str, sep: str = ", ", largest_first: bool = False,
                  verb: tuple[str, str] | None = None) -> str:
    """Clauses for ``incidents``: ``r1 (n0) waited for it in ...``, each rank its own
    up to ``GROUPS_SAID`` ranks (so 1- to 3-rank sentences are the plain per-rank
    ones).  Past that, ranks of which the same is said share a clause (``r1, r2, ...
    r8 +8183 more (on 1024 nodes) waited for it in ...``), and past ``GROUPS_SAID``
    clauses the remaining ranks are counted: ``12 more ranks {rest}``.  A job-wide
    stall at 8192 ranks reads as one clause, not 8191.  Clauses keep the order of
    ``incidents``, or with ``largest_first`` the largest groups come first.  ``verb``
    (singular, plural: ``("was", "were")``) comes before what is said, agreeing with
    the number of ranks."""
    def subject(who: str, num_ranks: int) -> str:
        return who if verb is None else f"{who} {verb[num_ranks > 1]}"

    if len(incidents) <= GROUPS_SAID:
        return sep.join(f"{subject(_rank(i), 1)} {say(i)}" for i in incidents)
    groups: dict[str, list[Incident]] = {}
    for i in incidents:
        groups.setdefault(say(i), []).append(i)
    ordered = list(groups.items())
    if largest_first:
        ordered.sort(key=lambda group: -len(group[1]))
    clauses = []
    for text, members in ordered[:GROUPS_SAID]:
        if len(members) == 1:
            clauses.append(f"{subject(_rank(members[0]), 1)} {text}")
            continue
        nodes = sorted({m.node_rank for m in members})
        on = (", ".join(f"n{n}" for n in nodes) if len(nodes) <= NODES_NAMED
              else f"on {len(nodes)} nodes")
        ranks = format_ranks(sorted(m.rank for m in members), RANKS_NAMED)
        clauses.append(f"{subject(f'{ranks} ({on})', len(members))} {text}")
    left = sum(len(members) for _, members in ordered[GROUPS_SAID:])
    if left:
        counted = f"{left} more rank{'s' if left > 1 else ''}"
        clauses.append(f"{subject(counted, left)} {rest}")
    return sep.join(clauses)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def stalled_finding(stalled: Sequence[Incident], run: RunData, end: float,
                    crashes: Sequence[Incident] = ()) -> Finding:
    """STALLED: who stopped, where, and who waits for whom."""
    culprits, waiters = stall_roles(stalled)
    named = culprits or [min(stalled, key=lambda s: s.began_at)]
    lead = named[0]
    why = said_of_ranks(
        named, lambda s: (f"made no progress for {_seconds(max(0.0, end - s.began_at))}"
                          f"{_at_step(s, run)} {where_phase(s)} ({_where(s)})"),
        "made no progress outside every collective")
    if culprits and waiters:
        why += "; " + said_of_ranks(
            waiters, lambda s: f"waited for it {where_phase(s)} ({_where(s)})",
            "waited for it elsewhere", largest_first=True)
    elif not culprits:
        why = (f"Every stalled rank is inside a collective, so no stack names one culprit: "
               f"{why}, the first to stop")
        if rest_waiting := [s for s in waiters if s is not lead]:
            why += "; " + said_of_ranks(rest_waiting, lambda s: f"{where_phase(s)} ({_where(s)})",
                                        "inside other collectives", largest_first=True)
    stalled_ranks = {s.rank for s in stalled}
    others = [r for r in range(run.meta.world_size) if r not in stalled_ranks]
    if others:
        why += f"; {format_ranks(others)} reported no stall"
    if crashes:
        why += "; then " + said_of_ranks(crashes, lambda c: _crash_clause(c, run),
                                         "failed after it", sep="; ")
    why += "."
    if not culprits:
        next_step = ("Make every rank call the same collectives in the same order: look for a "
                     "collective under a rank-only branch (if rank == 0), ranks with a "
                     f"different number of batches, or a rank that left the loop early; "
                     f"{_rank(lead)} stopped first at {_where(lead)}.")
    elif lead.phase == "input":
        next_step = (f"{_rank(lead)} is stuck fetching its batch: a DataLoader worker "
                     "hangs or died, or its storage stopped answering; DataLoader(timeout=...) "
                     "turns such a hang into an error that names it.")
    else:
        next_step = (f"Look at what {_rank(lead)} runs at {_where(lead)}: a rank-only "
                     "code path, a lock, blocking I/O or an endless loop; every other rank "
                     "waits for it in its next collective.")
    return Finding("STALLED", "STALLED", "crit", why, next_step,
                   tuple(s.rank for s in named),
                   {"stalled_s": max(0.0, end - lead.began_at),
                    "step": float(lead.step) if lead.step is not None else None},
                   tuple(sorted({s.node_rank for s in named})))


def cleared_finding(cleared: Sequence[Incident], stalls: Sequence[Incident],
                    run: RunData) -> Finding:
    """STALL CLEARED: the longest stall that ended with steps resuming."""
    longest = max(cleared, key=lambda s: (s.cleared_at or s.began_at) - s.began_at)
    duration = (longest.cleared_at or longest.began_at) - longest.began_at
    alongside = [s for s in stalls if s is not longest and s.began_at < (
        longest.cleared_at or longest.began_at) and (s.cleared_at or float("inf")) > longest.began_at]
    culprits, waiters = stall_roles([longest, *alongside])
    lead = culprits[0] if culprits else longest
    why = (f"{_rank(lead)} made no progress for {_seconds(duration)}{_at_step(lead, run)} "
           f"{where_phase(lead)} ({_where(lead)}); then its steps resumed")
    if waiters and lead not in waiters:
        why += "; " + said_of_ranks(waiters, lambda s: f"waited {where_phase(s)}",
                                    "waited elsewhere", largest_first=True)
    more = len([s for s in cleared if s is not longest and s not in alongside])
    if more:
        why += f"; {more} more stall{'s' if more > 1 else ''} cleared"
    return Finding("STALL_CLEARED", "STALL CLEARED", "warn", why + ".",
                   f"Look at what {_rank(lead)} runs at {_where(lead)}: that pause cost "
                   "every rank its duration.", (lead.rank,), {"stalled_s": duration})


def idle_finding(quiet: Sequence[Incident], end: float) -> Finding:
    """NO PROGRESS BEFORE EXIT: idle after the last event, then a clean exit."""
    lead = max(quiet, key=lambda s: end - s.began_at)
    return Finding("NO_PROGRESS_BEFORE_EXIT", "NO PROGRESS BEFORE EXIT", "info",
                   f"r{lead.rank} made no step progress for {_seconds(end - lead.began_at)} "
                   f"before the run exited normally, {where_phase(lead)} ({_where(lead)}); "
                   "work outside the training loop (saving, evaluation without a model call) "
                   "looks like this.", "", tuple(s.rank for s in quiet))


def _crash_clause(c: Incident, run: RunData) -> str:
    """``failed at step 25 in communication (RuntimeError: Connection closed)``, said of
    a rank."""
    kind = c.detail.get("type") or c.detail.get("signal") or f"exit {c.detail.get('exit_code')}"
    message = str(c.detail.get("message") or "")
    said = f"{kind}: {_short(message)}" if message else str(kind)
    return f"failed{_at_step(c, run)} {where_phase(c)} ({said})"


def _short(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def crash_not_confirmed(crashes: Sequence[Incident]) -> Finding:
    """Crash reports in a run whose launcher saw it exit 0: a rank that crashed and was
    restarted (--max-restarts), or a report that is not true.  Never the verdict."""
    ranks = tuple(dict.fromkeys(i.rank for i in crashes))
    why = (f"{format_ranks(ranks)} reported a crash, but the job exited 0 as its launcher "
           "saw it: a rank restarted by --max-restarts, or a report that is not true; the "
           "exit status decides how the run ended.")
    next_step = ("If ranks were restarted, the workers' logs of the earlier attempt say why; "
                 "otherwise find what in the job sends traceml's messages besides its ranks.")
    return Finding("CRASH_NOT_CONFIRMED", "CRASH NOT CONFIRMED", "info", why, next_step, ranks,
                   {"num_ranks": float(len(ranks))})


def crash_finding(crashes: Sequence[Incident], run: RunData,
                  left_waiting: Sequence[Incident] = ()) -> Finding:
    """CRASHED (or FAILED): the first rank to die, how, where; who followed, and who
    was left waiting for it."""
    first = crashes[0]
    rank, at = _rank(first), f"{_at_step(first, run)} {where_phase(first)}"
    detail = first.detail
    kind = "CRASHED"
    if detail.get("capacity_bytes") is not None or "requested_bytes" in detail:
        why = f"{rank} ran out of CUDA memory{at} ({_where(first)}): {_memory(first)}"
        next_step = ("Lower the batch size or sequence length, or use activation checkpointing "
                     "or lower precision; when reserved is far above allocated, "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation.")
    elif detail.get("type") is not None:
        message = _short(str(detail.get("message") or ""))
        said = f"{detail['type']}: {message}" if message else str(detail["type"])
        why = f"{rank} raised {said}{at} ({_where(first)})"
        next_step = (f"Fix the error at {_where(first)}; the workers' output above has the "
                     "whole traceback.")
    elif detail.get("signal") is not None:
        sig = str(detail["signal"])
        why = f"{rank} was killed by {sig}{at}"
        if sig == "SIGKILL":
            why += f" (no stack: SIGKILL cannot be caught); {_kill_reason(first, run)}"
            next_step = ("If memory ran out, lower the host memory per rank (DataLoader "
                         "workers, pinned buffers, caches); check the kernel log (dmesg) "
                         "and the scheduler's log for who sent it.")
        else:
            why += f" ({_where(first)})"
            next_step = ("A fatal signal comes from native code (a C extension, a custom "
                         "kernel, a library mismatch): run that rank's step alone with "
                         "faulthandler on, or under gdb, to find the native frame.")
    else:
        kind = "FAILED"
        why = (f"{rank} exited with status {detail.get('exit_code')}{at} without an uncaught "
               "exception (the script exited by itself: sys.exit, os._exit)")
        next_step = "Read that rank's output above for why it chose to exit."
    code = detail.get("exit_code")
    if code is not None and detail.get("signal") is None and kind == "CRASHED":
        why += f"; exit {code}"
    followers = crashes[1:]
    if followers:
        why += "; then " + said_of_ranks(followers, lambda c: _crash_clause(c, run),
                                         "failed after it", sep="; ")
    waiting_ranks = [s for s in left_waiting if s.rank != first.rank and waiting(s)]
    if waiting_ranks:
        why += "; " + said_of_ranks(
            waiting_ranks, lambda s: f"left waiting for it {where_phase(s)}",
            "left waiting for it elsewhere", largest_first=True, verb=("was", "were"))
    return Finding(kind, kind, "crit", why + ".", next_step, (first.rank,),
                   {"step": float(first.step) if first.step is not None else None},
                   (first.node_rank,))


def _memory(i: Incident) -> str:
    d = i.detail
    parts = []
    for key, name in (("allocated_bytes", "allocated"), ("reserved_bytes", "reserved")):
        value = d.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{format_bytes(value)} {name}")
    text = ", ".join(parts) or "memory not read"
    capacity = d.get("capacity_bytes")
    if isinstance(capacity, (int, float)):
        text += f" of {format_bytes(capacity)}"
    asked = d.get("requested_bytes")
    if isinstance(asked, (int, float)):
        text += f"; it asked for {format_bytes(asked)} more"
    return text


def _kill_reason(i: Incident, run: RunData) -> str:
    """Why a SIGKILL likely came: host memory on the rank's node just before it."""
    recent = [s.ram_pct for s in run.system
              if s.node_rank == i.node_rank and i.began_at - RAM_LOOKBACK_S <= s.t <= i.began_at + 1]
    if not recent:
        return "host memory was not sampled then, so who sent it is not known"
    peak = max(recent)
    if peak >= OOM_KILLER_RAM_PCT:
        return (f"host memory was {peak:.0f}% full just before: likely the kernel's "
                "out-of-memory killer")
    return (f"host memory was {peak:.0f}% full, so not the out-of-memory killer: sent from "
            "outside (a scheduler's limit, a user, another tool)")


def launcher_lost_finding(run: RunData) -> Finding:
    """A run whose launcher (or, under ``traceml.init()``, whose one training process)
    ended without recording the end: its collector recorded when it saw it go."""
    meta = run.meta
    at = time.strftime("%H:%M:%S", time.localtime(meta.ended_at))
    last = max((t.last_step for t in rank_totals(run).values()), default=None)
    steps = f"; last step recorded: {last}" if last is not None else "; no step recorded"
    into = f"{meta.ended_at - meta.started_at:.1f} s into the run{steps}"
    if meta.lost == "process":
        why = (f"The training process ended at {at} ({into}) without recording the end: "
               "killed (kill -9, the OOM killer, a signal it does not handle), or it left "
               "without running its exit handlers (os._exit, a crash in native code). Its "
               "exit status is unknown; the collector stored what had arrived, then stopped.")
        next_step = ("Look for the OOM killer in the kernel log (dmesg) and for a native "
                     "crash in the process's output; run again for a whole record.")
    else:
        why = (f"The launcher ended at {at} ({into}) without recording the end: killed "
               "(kill -9, the OOM killer), lost with its node, or it failed. The ranks' exit "
               "statuses are unknown; the collector stored what had arrived, then stopped. "
               "As with torchrun, whose workers run in their own sessions, the ranks were "
               "not stopped: they may have gone on, untraced.")
        next_step = ("Check whether the ranks still run (ps, nvidia-smi) and stop them; look "
                     "for the OOM killer in the kernel log (dmesg); run again for a whole "
                     "record.")
    return Finding("LAUNCHER_LOST", "LAUNCHER LOST", "crit", why, next_step, (),
                   {"lost_after_s": meta.ended_at - meta.started_at})


def ended_before_first_step(exit_code: int | None) -> Finding:
    """The run's headline when nothing trained and nothing says why."""
    failed = exit_code not in (0, None)
    why = (f"The run ended (exit {exit_code}) before any rank completed a training step, so "
           "nothing was trained and the sections below only cover the start-up.")
    next_step = ("Read the workers' error output above (the first traceback is the cause), "
                 "fix the set-up and run again." if failed else
                 "If this script trains, no optimizer step or backward was seen: see 'How "
                 "steps are found' in traceml's README, or mark steps with traceml.trace_step.")
    return Finding("ENDED_BEFORE_FIRST_STEP", "ENDED BEFORE THE FIRST STEP",
                   "crit" if failed else "info", why, next_step, (), {"exit_code": exit_code})
