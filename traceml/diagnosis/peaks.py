"""Peak FLOP/s of accelerators, for MFU (offline analysis).

Runs in the offline-analysis process.  Dense peaks (no 2:4 sparsity), in
TFLOP/s, per dtype, as each vendor's datasheet states them; the datasheets
quote the sparse figure for tensor-core dtypes, and the dense one is half of
it.  A device is matched on the name ``torch.cuda.get_device_name()`` reports
(ROCm reports AMD's names the same way).  A MIG slice (``... MIG 1g.10gb``)
gets the full GPU's peak times its share of the multiprocessors when the
agent read them, else times its compute slices out of 7.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class Accelerator:
    """One row of the table."""

    name: str  # as the report names it
    pattern: str  # a regular expression matched against the device name, case-insensitive
    tflops: tuple[float | None, float | None, float | None, float | None]  # per DTYPES
    num_sms: int | None  # multiprocessors of the full device (for MIG slices)
    source: str


_A100 = (312.0, 312.0, 156.0, 19.5)
_H100_SXM = (989.4, 989.4, 494.7, 66.9)
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021)"
_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023)"
_NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024)"

# Order matters: the first row whose pattern matches wins (H100 NVL before H100).
ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("B200", r"\bB200\b", (2250.0, 2250.0, 1125.0, 75.0), 148,
                "NVIDIA HGX B200 specifications (2024), per GPU of 8"),
    Accelerator("GH200", r"\bGH200\b", _H100_SXM, 132, "NVIDIA GH200 Grace Hopper datasheet (2023)"),
    Accelerator("H200 NVL", r"\bH200 NVL\b", (835.5, 835.5, 417.5, 60.0), 132, _NVIDIA_H200),
    Accelerator("H200", r"\bH200\b", _H100_SXM, 132, _NVIDIA_H200),
    Accelerator("H100 NVL", r"\bH100 NVL\b", (835.5, 835.5, 417.5, 60.0), 132, _NVIDIA_H100),
    Accelerator("H100 PCIe", r"\bH100 PCIe\b", (756.5, 756.5, 378.0, 51.2), 114, _NVIDIA_H100),
    Accelerator("H100 SXM", r"\bH100\b", _H100_SXM, 132, _NVIDIA_H100),
    Accelerator("A100", r"\bA100\b", _A100, 108, _NVIDIA_A100),
    Accelerator("L40S", r"\bL40S\b", (362.05, 362.05, 183.0, 91.6), 142,
                "NVIDIA L40S datasheet (2023)"),
    Accelerator("L4", r"\bL4\b", (121.0, 121.0, 60.0, 30.3), 58, "NVIDIA L4 datasheet (2023)"),
    Accelerator("A10G", r"\bA10G\b", (125.0, 125.0, 62.5, 31.2), 80,
                "NVIDIA A10G datasheet for Amazon EC2 G5 (2022)"),
    Accelerator("A10", r"\bA10\b", (125.0, 125.0, 62.5, 31.2), 72, "NVIDIA A10 datasheet (2021)"),
    Accelerator("MI300X", r"\bMI300X\b", (1307.4, 1307.4, 653.7, 163.4), 304,
                "AMD Instinct MI300X datasheet (2023)"),
)

_MIG = re.compile(r"\bMIG (\d+)g\.", re.IGNORECASE)
MIG_SLICES = 7  # compute slices of a full A100/H100/H200


@dataclass(frozen=True)
class Peak:
    """The peak an MFU is taken against, and where it came from."""

    tflops: float | None  # None: no peak known (MFU is then null)
    device: str  # the accelerator matched, or the device name as reported
    dtype: str | None
    source: str  # why this peak (or why none)


def match(device_name: str) -> Accelerator | None:
    """The table's row for a device name torch reports; None when unknown."""
    for acc in ACCELERATORS:
        if re.search(acc.pattern, device_name, re.IGNORECASE):
            return acc
    return None


def peak_for(device_name: str | None, dtype: str | None, sm_count: int | None = None,
             override_tflops: float | None = None) -> Peak:
    """The peak TFLOP/s of ``device_name`` in ``dtype`` (see the module docstring)."""
    name = device_name or "unknown device"
    if override_tflops:
        return Peak(override_tflops, name, dtype, f"--peak-tflops {override_tflops:g}")
    if device_name is None or device_name == "cpu":
        return Peak(None, name, dtype, "no peak table for CPUs: MFU is not computed on CPU "
                    "(pass --peak-tflops to set one)")
    acc = match(device_name)
    if acc is None:
        return Peak(None, name, dtype, f"{device_name!r} is not in traceml's table of "
                    "accelerators (pass --peak-tflops)")
    if dtype not in DTYPES:
        return Peak(None, acc.name, dtype, f"the table has no {dtype or 'unknown'} peak for "
                    f"{acc.name} (pass --peak-tflops)")
    full = acc.tflops[DTYPES.index(dtype)]
    if full is None:
        return Peak(None, acc.name, dtype, f"{acc.name} has no {dtype} peak (pass --peak-tflops)")
    mig = _MIG.search(device_name)
    if mig is None:
        return Peak(full, acc.name, dtype, f"{acc.name} dense {dtype} {full:g} TFLOP/s "
                    f"({acc.source})")
    slices = int(mig.group(1))
    if sm_count and acc.num_sms:
        share, how = sm_count / acc.num_sms, f"{sm_count} of {acc.num_sms} SMs"
    else:
        share, how = slices / MIG_SLICES, f"{slices} of {MIG_SLICES} compute slices"
    return Peak(full * share, f"{acc.name} MIG {slices}g", dtype,
                f"{acc.name} dense {dtype} {full:g} TFLOP/s ({acc.source}) x {how} of this "
                "MIG slice")
