"""Every threshold the diagnosis rules use, named and documented (offline analysis).

Runs in the offline-analysis process. Values marked "SPEC §7" are the
specification's starting thresholds; the others are traceml's own choices,
documented here and in docs/summary-schema.md. Percentages are 0..100.
"""

from __future__ import annotations

MIB = 1024 * 1024

# --- Window -------------------------------------------------------------------

WARMUP_MAX_STEPS = 5
"""At most this many of the first aligned steps are left out as warm-up."""

WARMUP_FRACTION = 0.10
"""...and at most this fraction of them: warm-up = min(5, floor(10 % of aligned steps)).
Short runs (< 10 aligned steps) keep every step."""

# --- Step Time (shares = median over ranks of phase mean / step mean) --------

INPUT_SHARE_WARN_PCT = 10.0  # SPEC §7 INPUT-BOUND
INPUT_SHARE_CRIT_PCT = 20.0  # SPEC §7
WAIT_SHARE_WARN_PCT = 10.0  # SPEC §7 WAIT-HEAVY
WAIT_SHARE_CRIT_PCT = 20.0  # SPEC §7
COMPUTE_SHARE_PCT = 85.0  # SPEC §7 COMPUTE-BOUND (info), only when nothing else fired

STRAGGLER_WARN_PCT = 10.0
"""SPEC §7: a rank's own work in one part (input, a compute phase, untraced host
work) exceeds the reference rank's by this share of the median step time. The
reference for rank r is the median of the *other* ranks, so with 2 ranks the
reference is the other rank."""

STRAGGLER_CRIT_PCT = 20.0  # SPEC §7

BORDERLINE_MARGIN = 0.10
"""traceml (issue 21): a share or excess within this fraction of its warn threshold
(9-11 % against 10 %) is BORDERLINE (info): run-to-run noise would flip a yes/no
there, so both sides of the threshold say the same thing."""

STRAGGLER_EXPLAINS_FRACTION = 0.5
"""traceml (SPEC R-COMM-2): another rank's excess explains a candidate's (which
may be waiting for it) when it is at least this fraction of the candidate's."""

STRAGGLER_MIN_SLOWER_PCT = 75.0
"""traceml (SPEC R-COMM-4): a rank is named only when its excess holds step by step:
its own time in the part exceeds the other ranks' median in at least this share of
the window's steps, in each half of the window (a clear majority, early and late).
Two ranks that share two cores with their communication threads take turns being
slower (about 70/30); a rank with twice the rows, or a busy process on its core, is
slower in 95-100 % of the steps."""

STRAGGLER_MIN_SIGNAL_TO_NOISE = 1.5
"""traceml (SPEC R-COMM-4): ...and its typical (median) per-step excess is at least
this many times the step-to-step noise it is held against: the smaller of the
spread of the per-step excess itself and the other ranks' own step-to-step spread
in that part (spreads are IQR / 1.349, the standard deviation of normal noise with
that interquartile range). On 2-rank gloo DDP sharing 2 cores, ranks taking turns
read 0.0-1.0 (10 runs); a rank with twice the rows or a busy process on its core
reads 1.9-24 (20 runs), a sleep-injected one far more."""

STRAGGLER_SIBLING_FRACTION = 0.5
"""traceml: a straggler's other compute phases at least this fraction of the
straggler limit slower are named with it ("r1 forward and backward"), and tested
step by step together (a rank with more rows is slower in both)."""

STRAGGLER_MIN_STEPS = 6
"""traceml: fewer window steps than this (3 per half) cannot show an excess holding
step by step; the rule then says it cannot tell rather than name a rank."""

GPU_MIN_TIMED_STEPS = STRAGGLER_MIN_STEPS
"""On CUDA the rules read the GPU's times (COMMUNICATION-BOUND's wait, stragglers'
compute) only when every rank has at least this many GPU-timed typical steps."""

COMM_SHARE_WARN_PCT = 10.0  # SPEC R-COMM-3 COMMUNICATION-BOUND: exposed communication share
COMM_SHARE_CRIT_PCT = 20.0  # SPEC R-COMM-3

# --- Throughput ---------------------------------------------------------------

MFU_LOW_WARN_PCT = 20.0
"""traceml (issue 18) LOW MFU: the job's model FLOPs utilization (achieved FLOP/s over
the device's dense peak in the step's dtype) below this on a known accelerator. Large
dense transformers reach 35-55 %; under 20 % something other than the model's math
takes the time (input, communication, host work, or kernels too small to fill the GPU)."""

# --- Step Memory --------------------------------------------------------------

CREEP_MIN_GROWTH_BYTES = 64 * MIB
"""traceml (issue 17; SPEC §7 started from 256 MiB between the window's thirds): creep
is a least-squares trend over the window that rises at least this much from its
first step to its last...  (Thirds compared at 256 MiB sat on the floor: a loop
keeping 1 MB per step for 300 steps was found on one run and missed on the next.)"""

CREEP_MIN_GROWTH_PCT = 10.0
"""...and at least this share of where the trend started (SPEC §7's 10 %)..."""

CREEP_MIN_R2 = 0.8
"""...and rises steadily: the line explains at least this share of the variance (R²),
so allocator noise on a flat run, or one jump halfway, is not creep."""

CREEP_MIN_STEPS = 9
"""Creep needs at least this many steps in the window; fewer steps: no verdict."""

PRESSURE_WARN_PCT = 92.0  # SPEC §7 HIGH PRESSURE: device peak reserved / capacity
PRESSURE_CRIT_PCT = 97.0  # SPEC §7
IMBALANCE_SKEW_PCT = 20.0  # SPEC §7 IMBALANCE: (max - min) / max of ranks' peak reserved
IMBALANCE_MIN_PRESSURE_PCT = 30.0  # SPEC §7: ...while the heaviest rank is this full

# --- Process ------------------------------------------------------------------

OVERHANG_RATIO = 1.5  # SPEC §7 RESERVED OVERHANG: peak reserved / peak allocated
OVERHANG_MIN_RESERVED_PCT = 30.0  # SPEC §7: ...and peak reserved this share of the device
HIGH_RSS_WARN_PCT = 80.0  # SPEC §7 HIGH RSS: a rank's peak RSS / host RAM
HIGH_RSS_CRIT_PCT = 95.0  # traceml: an OOM kill is imminent

HIGH_CPU_SHARE_PCT = 95.0
"""traceml HIGH CPU: a rank's average CPU % reaches this share of its cores, where
its cores = the node's CPUs / the ranks sampled on that node (100 % = one core).
One rank on a 16-core host is flagged at >= 1520 %; 8 ranks on it at >= 190 %."""

# --- System -------------------------------------------------------------------

CPU_PRESSURE_PCT = 85.0  # SPEC §7: host CPU average over the samples
RAM_PRESSURE_PCT = 85.0  # SPEC §7: host RAM, peak over the samples
RAM_PRESSURE_CRIT_PCT = 95.0  # traceml
LOW_GPU_UTIL_PCT = 30.0  # SPEC §7: a GPU's average utilization below this
HIGH_GPU_TEMP_C = 85.0  # SPEC §7: a GPU's peak temperature at or above this

# --- Outlier steps --------------------------------------------------------------

OUTLIER_STEP_RATIO = 2.0
"""traceml (issue 17): a step that took at least this many times its rank's median
step is an outlier. The typical step the Step Time rules diagnose leaves them out."""

OUTLIER_MAD_FACTOR = 10.0
"""...and at least this many median absolute deviations above the median step: on a
busy host whose steps spread wide, a step twice the median is noise, not an outlier.
(10 MADs are about 7 standard deviations of normal noise.)"""

OUTLIER_MIN_STEPS = 10
"""Outliers are looked for only in windows of at least this many steps."""

OUTLIER_MAX_FRACTION = 0.2
"""More slow steps than this fraction of the window are not outliers but how the
run goes (every other step slow): they stay in the typical step."""

OUTLIER_WARN_PCT = 10.0
"""OUTLIER STEPS is warn when the outliers' time beyond the median step is this
share of the window's wall time (crit at OUTLIER_CRIT_PCT); info below."""

OUTLIER_CRIT_PCT = 20.0

RAM_LOOKBACK_S = 15.0
"""How far before a SIGKILL the host memory samples are read (the ending's OOM check)."""
