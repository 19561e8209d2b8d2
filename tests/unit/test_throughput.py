"""Throughput and MFU: the peak table on real device names, MFU on hand-built 1-, 2-
and 8-rank runs (null on CPU and unknown devices), LOW MFU and its advice, FLOPs of
an MLP and a transformer block against the hand count, and compare when the batch
changed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tests.rows import step_row
from tests.unit.test_compare_verdict import compare, summary, tight
from traceml.agent.flops import _counter_class, dominant
from traceml.diagnosis.peaks import ACCELERATORS, peak_for
from traceml.diagnosis.throughput import LOW_MFU_NEXT, last_count, last_counts, low_mfu
from traceml.records import FlopCount, NodeInfo, RunData, RunMeta
from traceml.report import build_report

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200", "fp32", 66.9),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
    ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("NVIDIA B200", "bf16", 2250.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA A10G", "fp32", 31.2),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("AMD Instinct MI300X VF", "tf32", 653.7),
])
def test_the_table_picks_the_peak_for_real_device_names(name: str, dtype: str,
                                                        tflops: float) -> None:
    peak = peak_for(name, dtype)
    assert peak.tflops == tflops
    assert "datasheet" in peak.source or "specifications" in peak.source


def test_a_mig_slice_gets_its_share_of_the_gpu() -> None:
    by_sms = peak_for("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", sm_count=16)
    assert by_sms.tflops == pytest.approx(989.4 * 16 / 132)
    assert "16 of 132 SMs" in by_sms.source and by_sms.device == "H100 SXM MIG 1g"
    by_slices = peak_for("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16")
    assert by_slices.tflops == pytest.approx(312.0 * 3 / 7)


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB",
                                  "cpu", None])
def test_unknown_devices_and_cpu_have_no_peak(name: str | None) -> None:
    peak = peak_for(name, "bf16")
    assert peak.tflops is None
    assert "--peak-tflops" in peak.source
    assert peak_for(name, "bf16", override_tflops=100.0).tflops == 100.0


def test_a_dtype_without_a_peak_is_not_guessed() -> None:
    assert peak_for(H100, "float64").tflops is None
    assert peak_for(H100, None).tflops is None


def test_every_row_names_its_source_and_four_dtypes() -> None:
    for acc in ACCELERATORS:
        assert acc.source and len(acc.tflops) == 4
        bf16, fp16, tf32, fp32 = acc.tflops
        assert bf16 and fp16 and tf32 and fp32 and fp32 < tf32 <= bf16


# --- MFU on hand-built runs -----------------------------------------------------------


def run(world: int, device_name: str | None = H100, flops: float | None = 3e13,
        step_ms: float = 100.0, input_ms: float = 2.0, peak_tflops: float | None = None,
        samples: int | None = 64) -> RunData:
    meta = RunMeta(
        session_id="t", command=["train.py"], started_at=1_767_225_600.0,
        ended_at=1_767_225_700.0, exit_code=0, partial=False, world_size=world,
        missing_ranks=(), nodes=(NodeInfo(0, "box", tuple(range(world))),),
        device="cuda" if device_name not in (None, "cpu") else "cpu",
        versions={"traceml": "0.1.0", "torch": "2.5.1", "python": "3.11.7"},
        transport={"sent": 1, "dropped": 0, "gaps": 0, "rejected": 0}, peak_tflops=peak_tflops)
    rest = step_ms - input_ms
    steps = tuple(step_row(r, s, input_ms, 0.3 * rest, 0.6 * rest, 0.1 * rest, step_ms, 0.0,
                           samples=samples, flops=flops if s >= 6 else None,
                           flops_counted=s == 6)
                  for r in range(world) for s in range(60))
    counts = () if device_name is None else tuple(
        FlopCount(meta.started_at + 6, flops, "bf16", 0.99, device_name, 132, None, rank=r)
        for r in range(world))
    return RunData(meta, steps, (), (), counts)


def throughput(data: RunData) -> Any:
    return build_report(data, 10_000).throughput


@pytest.mark.parametrize("world", [1, 2, 8])
def test_mfu_and_the_job_sums(world: int) -> None:
    section = throughput(run(world))
    job = section.job
    # 3e13 FLOPs per 100 ms step = 300 TFLOP/s per rank, against 989.4
    assert all(r.achieved_tflops == pytest.approx(300.0) for r in section.ranks)
    assert all(r.mfu_pct == pytest.approx(100 * 300 / 989.4) for r in section.ranks)
    assert job.mfu_pct == pytest.approx(100 * 300 / 989.4)
    assert job.achieved_tflops == pytest.approx(300.0 * world)
    assert job.samples_per_s == pytest.approx(640.0 * world)
    # steps 5..59 after warm-up, without step 6 (counted on every rank)
    assert (section.scope.num_counted_steps, section.scope.num_steps) == (1, 54)
    assert section.diagnosis.kind == "THROUGHPUT"
    assert "H100 SXM dense bf16 989.4" in job.peak_source


@pytest.mark.parametrize(("name", "why"), [("cpu", "CPU"), ("NVIDIA RTX A6000", "not in")])
def test_mfu_is_null_on_cpu_and_unknown_devices_and_says_why(name: str, why: str) -> None:
    section = throughput(run(2, device_name=name))
    assert section.job.mfu_pct is None and all(r.mfu_pct is None for r in section.ranks)
    assert section.job.achieved_tflops == pytest.approx(600.0)  # still shown
    assert why in section.job.peak_source
    labels = [f.label for f in section.findings]
    assert "MFU NOT MEASURED" in labels and not any("LOW MFU" in lb for lb in labels)


def test_peak_override_gives_mfu_anywhere() -> None:
    section = throughput(run(1, device_name="cpu", peak_tflops=600.0))
    assert section.job.mfu_pct == pytest.approx(50.0)
    assert section.job.peak_source == "--peak-tflops 600"


@pytest.mark.parametrize("world", [1, 2, 8])
def test_low_mfu_advice_follows_step_time(world: int) -> None:
    # 5e12 per 100 ms = 50 TFLOP/s, 5.1 % of an H100
    compute = throughput(run(world, flops=5e12)).diagnosis
    assert (compute.label, compute.severity) == ("LOW MFU", "warn")
    assert "batch" in compute.next and "bf16" in compute.next
    starved = throughput(run(world, flops=5e12, input_ms=30.0)).diagnosis
    assert "INPUT-BOUND" in starved.next
    near = throughput(run(world, flops=1.9e13)).diagnosis  # 19.2 %
    assert (near.label, near.severity) == ("BORDERLINE LOW MFU", "info")


@pytest.mark.parametrize(("kind", "cause"), [
    ("HOST_STRAGGLER", "host"), ("WAIT_HEAVY", "host"), ("INPUT_STRAGGLER", "input"),
    ("COMMUNICATION_BOUND", "communication"), ("COMPUTE_STRAGGLER", "compute")])
def test_low_mfu_advice_names_every_step_time_cause(kind: str, cause: str) -> None:
    job = throughput(run(1, flops=5e12)).job
    (found,) = low_mfu(job, [kind])
    assert found.next == LOW_MFU_NEXT[cause]


def test_each_rank_takes_its_latest_count_that_counted() -> None:
    """A count that counted outlives a later abstention; a rank with only abstentions
    keeps its latest; ranks' records interleave as they arrive (8 ranks)."""
    def count(t: float, flops: float | None, rank: int) -> FlopCount:
        return FlopCount(t, flops, "bf16", 1.0, H100, 132, None if flops else "compiled",
                         rank=rank)
    counts = [count(1.0, 1e12, r) for r in range(0, 8, 2)]  # even ranks counted
    counts += [count(2.0, None, r) for r in range(8)]  # then every rank abstained
    counts += [count(3.0, 2e12, 4), count(4.0, None, 5)]
    latest = last_counts(counts)
    assert {r: (c.t, c.flops) for r, c in latest.items()} == {
        0: (1.0, 1e12), 1: (2.0, None), 2: (1.0, 1e12), 3: (2.0, None),
        4: (3.0, 2e12), 5: (4.0, None), 6: (1.0, 1e12), 7: (2.0, None)}
    assert all(last_count(counts, r) == latest[r] for r in range(8))
    assert last_count(counts, 8) is None


def test_no_count_says_why() -> None:
    section = throughput(run(2, device_name=None, flops=None))
    assert section.job.achieved_tflops is None
    assert "no FLOP count arrived" in section.job.flops_source
    no_flops = run(1, device_name=None, flops=None)
    meta = no_flops.meta.__class__(**{**no_flops.meta.__dict__, "count_flops": False})
    section = throughput(RunData(meta, no_flops.steps, (), ()))
    assert section.job.flops_source == "not counted: --no-flops"


def test_samples_not_measured_says_the_rule() -> None:
    section = throughput(run(2, samples=None, device_name=None, flops=None))
    assert section.diagnosis.label == "THROUGHPUT NOT MEASURED"
    assert "leading dimension of the first tensor" in section.diagnosis.why


# --- FLOPs counted by the agent's counter against the hand count ------------------------


def count_step(model: nn.Module, x: torch.Tensor, autocast: bool = False) -> Any:
    counter = _counter_class()()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().sum()
        loss.backward()
    return counter


def test_mlp_flops_equal_the_hand_count() -> None:
    batch, d_in, hidden, d_out = 32, 64, 256, 10
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    counter = count_step(model, torch.randn(batch, d_in))
    first, second = 2 * batch * d_in * hidden, 2 * batch * hidden * d_out
    # forward both; backward: input and weight gradients of the second layer, the
    # weight gradient of the first (the batch needs no gradient)
    assert counter.get_total_flops() == pytest.approx(first + second + 2 * second + first,
                                                      rel=0.02)
    assert dominant(counter.by_kind)[0] == "fp32"


class Block(nn.Module):
    """A pre-norm transformer block with attention written out in matmuls."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


@pytest.mark.parametrize("autocast", [False, True])
def test_transformer_block_flops_equal_the_hand_count(autocast: bool) -> None:
    b, t, d, heads = 4, 32, 64, 4
    counter = count_step(Block(d, heads), torch.randn(b, t, d), autocast)
    tokens = b * t
    forward = (2 * tokens * d * 3 * d  # qkv
               + 2 * b * t * t * d  # q k^T over all heads
               + 2 * b * t * t * d  # att v
               + 2 * tokens * d * d  # proj
               + 2 * 2 * tokens * d * 4 * d)  # up, down
    # every matmul's input needs a gradient (layer norm weights before qkv): 3x forward
    assert counter.get_total_flops() == pytest.approx(3 * forward, rel=0.02)
    dtype, share, device = dominant(counter.by_kind)
    assert (dtype, device) == ("bf16" if autocast else "fp32", "cpu")
    assert share is not None and share > 0.9


# --- compare: throughput decides when the batch changed ------------------------------


def test_a_shrunk_batch_at_equal_step_time_is_a_regression() -> None:
    result = compare(summary(tight(100.0)), summary(tight(100.0), samples=16, session="b"))
    assert result.verdict.label == "REGRESSION"
    assert "Samples/s fell 50.0% (320 -> 160 samples/s)" in result.verdict.why


def test_half_the_batch_in_half_the_time_is_no_change() -> None:
    result = compare(summary(tight(100.0)), summary(tight(50.0), samples=16, session="b"))
    assert result.verdict.label == "NO CHANGE"
    assert "throughput, not step time, tells the speed" in result.verdict.why


def test_the_same_batch_keeps_the_step_time_verdict() -> None:
    assert compare(summary(tight(100.0)), summary(tight(90.0), session="b")).verdict.label == (
        "IMPROVEMENT")


# --- the agent's counting never breaks the step, and abstains with the reason ----------


def counting(compiled: bool = False) -> tuple[Any, Any]:
    from traceml.agent.flops import FlopCounting
    from traceml.agent.probe import Probe

    errors: list[Any] = []
    probe = Probe(lambda: 1.0, errors.append)
    probe.compiled = compiled
    flops = FlopCounting(probe, True, lambda part, exc: errors.append(exc))
    flops.arm()
    assert flops.on_shape(((8, 4), "torch.float32"), 0.0) is None  # armed: the count starts
    return probe, flops


def train_step(probe: Any) -> None:
    model = nn.Linear(4, 2)
    model(torch.randn(8, 4)).sum().backward()
    assert probe.on_optimizer_end is not None
    probe.on_optimizer_end()  # the optimizer step ended: the count ends


def test_a_count_is_logged_once_and_reused() -> None:
    probe, flops = counting()
    train_step(probe)
    (t, total, dtype, share, name, sm, reason, ran), = probe.flop_counts
    assert (total, dtype, name, reason, ran) == (2 * 8 * 4 * 2 * 2, "fp32", "cpu", None, True)
    assert probe.on_optimizer_end is None and flops.counter is None
    assert flops.on_shape(((8, 4), "torch.float32"), 2.0) == total  # the same shape: reused


def test_a_failing_flop_formula_abstains_and_the_step_still_runs() -> None:
    probe, flops = counting()

    def boom(*args: Any, **kwargs: Any) -> int:
        raise ValueError("no formula")

    flops.counter.flop_registry[torch.ops.aten.addmm] = boom
    train_step(probe)  # no exception reaches the training step
    assert probe.flop_counts[0][1] is None
    assert "no formula" in probe.flop_counts[0][6]


def test_torch_compile_abstains_without_counting() -> None:
    probe, flops = counting(compiled=True)
    assert flops.counter is None and probe.on_optimizer_end is None
    (_, total, *_, reason, ran), = probe.flop_counts
    assert (total, ran) == (None, False) and "torch.compile" in reason


def test_a_failing_device_mark_still_ends_the_count() -> None:
    from traceml.agent.flops import FlopCounting
    from traceml.agent.probe import Probe

    probe = Probe(lambda: 1.0, lambda exc: None)

    def mark(t: float | None = None) -> None:
        raise RuntimeError("CUDA mark failed")

    probe.on_optimizer_end = mark
    flops = FlopCounting(probe, True, lambda part, exc: None)
    flops.arm()
    flops.on_shape(((8, 4), "torch.float32"), 0.0)
    with pytest.raises(RuntimeError):  # the probe's guard catches it in the patches
        train_step(probe)
    assert flops.counter is None and probe.on_optimizer_end is mark
    assert len(probe.flop_counts) == 1


def test_the_per_rank_throughput_table_printed_at_the_end() -> None:
    from traceml.launcher.ending import throughput_table

    assert throughput_table(build_report(run(2), 10_000)) == (
        "traceml: throughput per rank (summary window)\n"
        "rank    samples/s    TFLOP/s    MFU %\n"
        "------  -----------  ---------  -------\n"
        "r0      640          300        30.3\n"
        "r1      640          300        30.3")
    assert throughput_table(build_report(run(1, samples=None, device_name=None, flops=None),
                                         10_000)) is None
