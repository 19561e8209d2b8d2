#!/usr/bin/env bash
# The CUDA path end to end, on a machine with an NVIDIA GPU (under 5 minutes).
#
#   scripts/gpu_check.sh [OUT_DIR]
#
# Checks, printing PASS/FAIL per line and exiting non-zero on any failure:
#   1. CUDA-event phase timing: forward/backward/optimizer GPU ms stored per
#      step, resolved with query() (the agent never calls synchronize()).
#   2. CUDA memory: per-step device peak allocated/reserved, and the process
#      samples' allocated/reserved/total.
#   3. NVML system samples for the job's GPUs (utilisation, memory, temperature,
#      power), honouring CUDA_VISIBLE_DEVICES.
#   4. A deliberately input-bound CUDA run is diagnosed INPUT-BOUND.
#   5. NCCL: 1-rank DDP on the GPU (NCCL refuses two ranks on one GPU) trains
#      under traceml with steps counted, and communication says "not measured"
#      rather than a host time that is not the GPU's (NCCL makes streams wait,
#      not the host): no communication phase, in flight null.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/traceml-gpu-check}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

cat > "$OUT/cuda_train.py" <<'PY'
import sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Data(Dataset):
    def __init__(self, sleep_s): self.sleep_s = sleep_s
    def __len__(self): return 60 * 64
    def __getitem__(self, i):
        if self.sleep_s: time.sleep(self.sleep_s)
        return torch.randn(1024), i % 10

sleep_s = float(sys.argv[1])
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                      nn.Linear(4096, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for x, y in DataLoader(Data(sleep_s), batch_size=64, pin_memory=True):
    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
PY

cat > "$OUT/nccl_train.py" <<'PY'
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("nccl")
torch.cuda.set_device(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda(),
    device_ids=[0], bucket_cap_mb=4)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for _ in range(40):
    x = torch.randn(64, 1024, device="cuda")
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    opt.step()
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
dist.destroy_process_group()
PY

"$PY" -m traceml run --logs-dir "$OUT/logs" --session-id nccl --sample-interval 0.5 \
    "$OUT/nccl_train.py" > "$OUT/nccl.txt" 2>&1
"$PY" -m traceml run --logs-dir "$OUT/logs" --session-id healthy --sample-interval 0.5 \
    "$OUT/cuda_train.py" 0 > "$OUT/healthy.txt" 2>&1
"$PY" -m traceml run --logs-dir "$OUT/logs" --session-id input --sample-interval 0.5 \
    "$OUT/cuda_train.py" 0.0005 > "$OUT/input.txt" 2>&1

"$PY" - "$OUT/logs" <<'PY'
import json, sqlite3, sys
logs = sys.argv[1]
failed = []

def check(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail else ""))
    if not ok:
        failed.append(name)

db = sqlite3.connect(f"{logs}/healthy/telemetry.sqlite")
rows = db.execute("SELECT gpu_forward_ms, gpu_backward_ms, gpu_optimizer_ms, "
                  "peak_allocated_bytes, peak_reserved_bytes, forward_ms FROM steps").fetchall()
timed = [r for r in rows if r[0] is not None]
check("CUDA-event phase times stored", len(timed) >= len(rows) - 3,
      f"{len(timed)}/{len(rows)} steps; median GPU fwd/bwd/opt ms "
      f"{sorted(r[0] for r in timed)[len(timed)//2]:.3f}/"
      f"{sorted(r[1] for r in timed)[len(timed)//2]:.3f}/"
      f"{sorted(r[2] for r in timed)[len(timed)//2]:.3f}" if timed else "none")
check("GPU times are positive", all(r[0] > 0 and r[1] > 0 and r[2] > 0 for r in timed))
check("per-step CUDA peaks", all(r[3] and r[4] and r[4] >= r[3] for r in rows[1:]),
      f"peak allocated {rows[-1][3]}, reserved {rows[-1][4]}")
proc = db.execute("SELECT device_allocated_bytes, device_reserved_bytes, device_total_bytes "
                  "FROM process").fetchall()
check("process samples carry device memory", proc and all(p[2] for p in proc),
      f"{len(proc)} samples, total {proc[-1][2] if proc else None}")
gpus = [json.loads(g) for (g,) in db.execute("SELECT gpus FROM system")]
check("NVML system samples", gpus and all(g for g in gpus),
      f"{len(gpus)} samples, first {gpus[0] if gpus else None}")
summary = json.load(open(f"{logs}/healthy/final_summary.json"))
check("summary device is cuda", summary["meta"]["device"] == "cuda")
label = json.load(open(f"{logs}/input/final_summary.json"))["step_time"]["diagnosis"]["label"]
check("input-bound CUDA run diagnosed INPUT-BOUND", label == "INPUT-BOUND", label)
nccl = sqlite3.connect(f"{logs}/nccl/telemetry.sqlite")
steps = nccl.execute("SELECT num_communication, communication_ms, collective_ms, "
                     "backward_ms FROM steps").fetchall()
check("NCCL DDP steps counted", len(steps) >= 39, f"{len(steps)} steps")
check("NCCL: no host time passed off as communication",
      all(s[0] == 0 and s[1] == 0 for s in steps),
      f"median backward {sorted(s[3] for s in steps)[len(steps)//2]:.3f} ms" if steps else "none")
check("NCCL: in flight not measured on CUDA (null)", all(s[2] is None for s in steps))
sys.exit(1 if failed else 0)
PY
