"""Throughput: samples/s, tokens/s, achieved FLOP/s and MFU; LOW MFU (offline analysis).

Runs in the offline-analysis process.  Per rank, over the step window: the
samples (tokens, FLOPs) of its window steps over the sum of their step times,
so a short last batch counts as what it was; FLOP/s over the window steps
that have a count (steps before the first count have none).  The job's samples/s and tokens/s
are the sum over ranks, each taken as a data-parallel replica (with tensor or
pipeline parallelism, ranks that share a batch make the sum overcount).  MFU is
achieved FLOP/s over the peak of the rank's device in the dtype most of its
FLOPs ran in (`traceml.diagnosis.peaks`), or ``--peak-tflops``; the job's MFU
is the sum of achieved over the sum of peaks.  Whatever cannot be told is
None, with the reason.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import (
    NOT_MEASURED,
    Finding,
    as_borderline,
    borderline,
    not_measured,
)
from traceml.diagnosis.peaks import Peak, peak_for
from traceml.diagnosis.window import StepWindow
from traceml.records import FlopCount, RunMeta, StepRow, column, ms_column

SAMPLES_RULE = ("the leading dimension of the first tensor in what each DataLoader fetch "
                "returned (or, without a DataLoader, what the outermost forward received)")
TOKENS_RULE = "that tensor's elements when it is 2-D with an integer dtype (token ids)"


@dataclass(frozen=True)
class RankThroughput:
    """One rank's throughput over the window."""

    rank: int
    node_rank: int | None
    num_steps: int
    samples_per_step: float | None  # mean over the window steps
    tokens_per_step: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    flops_per_step: float | None
    achieved_tflops: float | None
    peak_tflops: float | None  # of this rank's device and dtype; None: not known
    mfu_pct: float | None
    device_name: str | None
    dtype: str | None


@dataclass(frozen=True)
class JobThroughput:
    """The job's throughput (sum over ranks) and where its numbers came from."""

    samples_per_s: float | None
    tokens_per_s: float | None
    achieved_tflops: float | None
    mfu_pct: float | None
    peak_tflops: float | None  # per device, as the median rank's
    peak_device: str | None
    peak_dtype: str | None
    peak_source: str  # which peak and why (or why none)
    flops_source: str  # how the FLOPs per step were counted (or why not)


def _rate(values: Sequence[float | None], seconds: float, scale: float = 1.0) -> float | None:
    if not values or None in values or seconds <= 0:
        return None
    return sum(v for v in values if v is not None) / seconds / scale


def _mean(values: Sequence[float | None]) -> float | None:
    if not values or None in values:
        return None
    return statistics.fmean(v for v in values if v is not None)


def last_count(counts: Sequence[FlopCount], rank: int) -> FlopCount | None:
    """The rank's latest FLOP count that counted, else its latest record."""
    return last_counts(counts).get(rank)


def last_counts(counts: Sequence[FlopCount]) -> dict[int, FlopCount]:
    """Every rank's `last_count`, in one pass (a wide job has a count per rank)."""
    latest: dict[int, FlopCount] = {}
    for c in counts:
        if c.flops is not None or latest.get(c.rank, c).flops is None:
            latest[c.rank] = c
    return latest


def rank_throughput(window: StepWindow, node_of: Mapping[int, int],
                    counts: Sequence[FlopCount], override_tflops: float | None = None
                    ) -> dict[int, RankThroughput]:
    """Per-rank throughput over the window; ranks without window steps are left out."""
    out = {}
    latest = last_counts(counts)
    for rank, rows in window.by_rank.items():
        if not rows:
            continue
        totals, flops = ms_column(rows, "total"), column(rows, "flops")
        samples, tokens = column(rows, "samples"), column(rows, "tokens")
        seconds = sum(totals) / 1e3
        # Steps before the first count have no FLOPs yet: the rate is over those that do.
        counted = [(f, t) for f, t in zip(flops, totals) if f is not None]
        achieved = _rate([f for f, _ in counted], sum(t for _, t in counted) / 1e3, 1e12)
        count = latest.get(rank)
        peak = _peak(count, override_tflops)
        mfu = (100.0 * achieved / peak.tflops if achieved is not None and peak.tflops
               else None)
        out[rank] = RankThroughput(
            rank, node_of.get(rank), len(rows),
            _mean(samples), _mean(tokens), _rate(samples, seconds), _rate(tokens, seconds),
            _mean([f for f, _ in counted]), achieved, peak.tflops, mfu,
            count.device_name if count is not None else None,
            count.dtype if count is not None else None)
    return out


def _peak(count: FlopCount | None, override_tflops: float | None) -> Peak:
    if count is None:
        return peak_for(None, None, None, override_tflops)
    return peak_for(count.device_name, count.dtype, count.sm_count, override_tflops)


def _total(values: Sequence[float | None]) -> float | None:
    return None if not values or None in values else sum(
        v for v in values if v is not None)


def job_throughput(ranks: Mapping[int, RankThroughput], rows: Sequence[StepRow],
                   counts: Sequence[FlopCount], meta: RunMeta) -> JobThroughput:
    """The job's sums and the sources of its FLOPs and peak."""
    table = [ranks[r] for r in sorted(ranks)]
    peaks = _total([t.peak_tflops for t in table])
    achieved = _total([t.achieved_tflops for t in table])
    mfu = 100.0 * achieved / peaks if achieved is not None and peaks else None
    median = table[(len(table) - 1) // 2] if table else None
    count = last_count(counts, median.rank) if median is not None else None
    peak = _peak(count, meta.peak_tflops)
    return JobThroughput(
        _total([t.samples_per_s for t in table]), _total([t.tokens_per_s for t in table]),
        achieved, mfu, peak.tflops, peak.device if count is not None else None, peak.dtype,
        peak.source if count is not None else "no FLOP count, so no device or dtype to look up",
        flops_source(rows, counts, meta))


def flops_source(rows: Sequence[StepRow], counts: Sequence[FlopCount], meta: RunMeta) -> str:
    """How the window's FLOPs per step were counted, or why they were not."""
    if not meta.count_flops:
        return "not counted: --no-flops"
    if not counts:
        return ("not counted: no FLOP count arrived (it runs after 5 optimizer steps; "
                "the run was shorter, or the loop has no optimizer step)")
    failed = [c for c in counts if c.flops is None]
    known = sum(r.flops is not None for r in rows)
    ran = [c for c in counts if c.flops is not None]
    if known and ran:
        share = ran[-1].dtype_share
        dtype = f", {100 * share:.0f}% of them in {ran[-1].dtype}" if share is not None else ""
        num = f"{len(ran)} count" + ("" if len(ran) == 1 else "s")
        return (f"torch.utils.flop_counter.FlopCounterMode over one training step per batch "
                f"shape ({num} over all ranks{dtype}), for {known} of the window's "
                f"{len(rows)} rank-steps; counted steps are left out of the window")
    if failed:
        return f"not counted: {failed[-1].reason}"
    return "not counted for the window's steps: their batch shapes were past the first 8"


def _throughput_line(job: JobThroughput, num_ranks: int) -> str:
    parts = []
    if job.samples_per_s is not None:
        parts.append(f"{job.samples_per_s:,.1f} samples/s")
    if job.tokens_per_s is not None:
        parts.append(f"{job.tokens_per_s:,.0f} tokens/s")
    if job.achieved_tflops is not None:
        parts.append(f"{job.achieved_tflops:.3g} TFLOP/s achieved")
    if job.mfu_pct is not None:
        parts.append(f"MFU {job.mfu_pct:.1f}%")
    who = "the job" if num_ranks == 1 else f"the job, sum of {num_ranks} ranks"
    return f"{', '.join(parts)} ({who})."


LOW_MFU_NEXT = {
    "input": ("The GPUs wait for data first (see INPUT-BOUND): fix the input pipeline "
              "before tuning kernels; MFU rises with it."),
    "communication": ("Collectives take the time (see COMMUNICATION-BOUND): overlap or shrink "
                      "them first (DDP buckets, no_sync() with accumulation, a larger batch "
                      "per rank)."),
    "host": ("Time goes outside the traced phases (see WAIT-HEAVY): remove host syncs and "
             "logging from the loop first."),
    "compute": ("The step is compute but the kernels are small or slow: raise the batch "
                "per rank, run in bf16 (autocast), use torch.compile or fused kernels (flash "
                "attention, fused optimizers); torch.profiler shows which kernels dominate."),
}
"""LOW MFU's advice, by what else Step Time found."""

_CAUSE_OF = {"INPUT_BOUND": "input", "INPUT_STRAGGLER": "input",
             "COMMUNICATION_BOUND": "communication", "WAIT_HEAVY": "host",
             "HOST_STRAGGLER": "host"}


def low_mfu(job: JobThroughput, step_time_kinds: Sequence[str], num_ranks: int = 1
            ) -> list[Finding]:
    """LOW MFU: the job's MFU below MFU_LOW_WARN_PCT on a known accelerator (warn), with
    advice fitting what Step Time found; within the borderline margin it is info."""
    mfu = job.mfu_pct
    if mfu is None:
        return []
    level = thresholds.MFU_LOW_WARN_PCT
    near = borderline(mfu, level)
    if mfu >= level and not near:
        return []
    cause = next((_CAUSE_OF[k] for k in step_time_kinds if k in _CAUSE_OF), "compute")
    per_device = (job.achieved_tflops or 0.0) / max(1, num_ranks)
    why = (f"MFU was {mfu:.1f}%: {per_device:.3g} TFLOP/s achieved per rank against a "
           f"{job.peak_tflops:g} TFLOP/s peak ({job.peak_device} {job.peak_dtype}), below "
           f"{level:.0f}%.")
    found = Finding("LOW_MFU", "LOW MFU", "warn", why, LOW_MFU_NEXT[cause], (),
                    {"mfu_pct": mfu, "achieved_tflops": job.achieved_tflops,
                     "peak_tflops": job.peak_tflops})
    if near:  # mirrored: "above the threshold but near it" reads as borderline too
        found = as_borderline(found, level)
    return [found]


def diagnose_throughput(ranks: Mapping[int, RankThroughput], job: JobThroughput,
                        step_time_kinds: Sequence[str], unmeasured_why: str
                        ) -> tuple[Finding, ...]:
    """Throughput's findings: LOW MFU, else THROUGHPUT (info); then what was not measured."""
    if not ranks:
        return (not_measured("THROUGHPUT", unmeasured_why),)
    table = list(ranks.values())
    found = low_mfu(job, step_time_kinds, len(table))
    if job.samples_per_s is None and job.achieved_tflops is None:
        if not found:
            found.append(not_measured("THROUGHPUT", f"Samples per step follow {SAMPLES_RULE}; "
                                      "no window step's batch could be read that way."))
    elif not found:
        found.append(Finding("THROUGHPUT", "THROUGHPUT", "info",
                             _throughput_line(job, len(table)), "", (),
                             {"samples_per_s": job.samples_per_s,
                              "tokens_per_s": job.tokens_per_s,
                              "achieved_tflops": job.achieved_tflops, "mfu_pct": job.mfu_pct}))
    if job.samples_per_s is None and found[0].kind != NOT_MEASURED:
        found.append(not_measured("SAMPLES", f"Samples per step follow {SAMPLES_RULE}; not "
                                  "every window step's batch could be read that way."))
    if job.tokens_per_s is None and job.samples_per_s is not None:
        found.append(not_measured("TOKENS", f"Tokens are {TOKENS_RULE}; the batches are not."))
    if job.achieved_tflops is None:
        found.append(not_measured("FLOPS", f"FLOPs per step {job.flops_source}."))
    elif job.mfu_pct is None:
        found.append(not_measured("MFU", f"No peak FLOP/s: {job.peak_source}; "
                                  f"achieved {job.achieved_tflops:.3g} TFLOP/s."))
    return tuple(found)
