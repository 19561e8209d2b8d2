"""The step phases: the one table every process reads (shared: agent, collector, analysis).

A training step is cut into exclusive phases; ``wait`` is what is left
(``total`` minus every phase, never negative) and ``compute`` the sum of the
phases marked as compute.  Everything that names a phase derives it from
:data:`PHASES`: the agent's event codes, the step record the collector stores,
the store's columns, the rules, the report model, compare, the text card, the
live views and the page's JavaScript (which reads :func:`table_json` from the
document it renders).  Adding a phase is a change to this table alone.

Standard library only: every process imports it, the agent included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One column of a step: what it is called, how it is drawn and what it counts as."""

    name: str  # "input"; JSON keys are ``<name>_ms``, ``num_<name>``, ``<name>_share_pct``
    label: str  # "Input": tables, compare and the page
    colour: str  # the page's charts
    compute: bool = False  # part of ``compute`` (forward+backward+optimizer)
    collective: bool = False  # communication: blocked on collectives, or a comm hook's own work
    waits: bool = False  # blocked waiting for other ranks (exposed communication)
    gpu_timed: bool = False  # CUDA events time it too (``gpu_<name>_ms``)
    pending: bool = False  # its time waits to learn what it was for (a fetch: training
    # or evaluation?), so it never begins a step itself

    @property
    def column(self) -> str:
        """The stored and reported time column: ``input_ms``."""
        return f"{self.name}_ms"

    @property
    def count_column(self) -> str:
        """How many times the phase ran in the step: ``num_input``."""
        return f"num_{self.name}"

    @property
    def place_columns(self) -> tuple[str, str, str, str]:
        """Where its calls ran, ms from the step's begin
        (`traceml.collector.step_parts.Placement`): the first call's begin and end, the
        last call's begin and end (``input_at_ms``, ``input_end_ms``, ``input_last_at_ms``,
        ``input_last_end_ms``)."""
        return (f"{self.name}_at_ms", f"{self.name}_end_ms", f"{self.name}_last_at_ms",
                f"{self.name}_last_end_ms")

    @property
    def gpu_column(self) -> str:
        """GPU time of the phase (CUDA): ``gpu_forward_ms``."""
        return f"gpu_{self.name}_ms"


PHASES: tuple[Phase, ...] = (
    Phase("input", "Input", "#4e79a7", pending=True),
    Phase("forward", "Forward", "#59a14f", compute=True, gpu_timed=True),
    Phase("backward", "Backward", "#f28e2b", compute=True, gpu_timed=True),
    Phase("optimizer", "Optimizer", "#b07aa1", compute=True, gpu_timed=True),
    Phase("communication", "Communication", "#edc948", collective=True, waits=True,
          gpu_timed=True),
    Phase("hook", "Comm hook", "#9c755f", collective=True),
)
"""The measured phases in step order; a phase's wire code is its position."""

TOTAL = Phase("total", "Total step", "#333333")
"""Boundary to boundary: not a phase, the whole step."""

COMPUTE = Phase("compute", "Compute", "#76b7b2")
"""The sum of the compute phases."""

WAIT = Phase("wait", "Wait", "#e15759")
"""Untraced time: total minus every phase, never negative."""

STEP_BOUNDARIES = ("optimizer", "backward", "trace_step")
"""What ended a rank's steps: its optimizer steps; its backward passes, when no
torch.optim step was ever seen (a loop that updates parameters itself); or
``traceml.trace_step``."""


def code(name: str) -> int:
    """The wire code of a phase's begin event (its position in :data:`PHASES`)."""
    for index, phase in enumerate(PHASES):
        if phase.name == name:
            return index
    raise KeyError(f"no phase {name!r}")


def compute_names() -> tuple[str, ...]:
    """The phases that make up ``compute``."""
    return tuple(p.name for p in PHASES if p.compute)


def collective_names() -> tuple[str, ...]:
    """The phases that are communication: blocked on collectives (``communication``)
    and the synchronous part of DDP communication hooks (``hook``)."""
    return tuple(p.name for p in PHASES if p.collective)


def starts_step(phase: Phase) -> bool:
    """Whether this phase beginning marks training activity, which may begin a
    step (input waits for what follows; a collective belongs to the step it is in)."""
    return not phase.pending and not phase.collective


def gpu_timed() -> tuple[Phase, ...]:
    """The phases CUDA events time, in step order."""
    return tuple(p for p in PHASES if p.gpu_timed)


def gpu_compute() -> tuple[Phase, ...]:
    """The compute phases CUDA events time: a step's GPU compute time is their sum
    (communication's GPU time is the compute stream waiting on collectives)."""
    return tuple(p for p in PHASES if p.gpu_timed and p.compute)


def step_metrics() -> tuple[Phase, ...]:
    """What a per-rank Step Time row holds a distribution of: total, each phase,
    compute, wait."""
    return (TOTAL, *PHASES, COMPUTE, WAIT)


def stacked() -> tuple[Phase, ...]:
    """The parts that add up to the step, in drawing order: each phase, then wait."""
    return (*PHASES, WAIT)


def share_metrics() -> tuple[Phase, ...]:
    """The parts whose share of the step is reported: the phases outside compute,
    compute, wait."""
    return (*(p for p in PHASES if not p.compute), COMPUTE, WAIT)


def visible(parts: Sequence[Phase], spent: Callable[[Phase], bool]) -> tuple[Phase, ...]:
    """The parts a table shows: every one, except a collective phase no rank
    ``spent`` time in (a single-process run has no communication column)."""
    return tuple(p for p in parts if not p.collective or spent(p))


def describe(parts: tuple[Phase, ...]) -> str:
    """``input, forward, backward and optimizer``: phase names for a sentence."""
    words = [p.name for p in parts]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def table_json() -> list[dict[str, str | bool]]:
    """The table as the page reads it: every step metric with its kind."""
    return [
        {"name": p.name, "column": p.column, "label": p.label, "colour": p.colour,
         "kind": "phase" if p in PHASES else p.name, "compute": p.compute,
         "collective": p.collective, "waits": p.waits}
        for p in step_metrics()
    ]
