#!/usr/bin/env bash
# The CUDA path end to end, on a machine with an NVIDIA GPU (under 5 minutes).
#
#   scripts/gpu_check.sh [OUT_DIR]
#
# Checks, printing PASS/FAIL per line and exiting non-zero on any failure:
#   1. CUDA-event phase timing on a sample of steps: forward/backward/optimizer
#      GPU ms stored for every one of the first 25 steps (but the very first)
#      and for a sample after them, resolved with query() (the agent never
#      calls synchronize()); the summary counts those steps and takes its GPU
#      time from them only (JSON and card).
#   2. CUDA memory: device peak allocated/reserved read on the timed steps
#      only, each covering the steps since the previous one: a 512 MiB spike
#      on an untimed step is not lost; and the process samples'
#      allocated/reserved/total.
#   3. NVML system samples for the job's GPUs (utilisation, memory, temperature,
#      power), honouring CUDA_VISIBLE_DEVICES.
#   4. A deliberately input-bound CUDA run is diagnosed INPUT-BOUND.
#   5. NCCL: 1-rank DDP on the GPU (NCCL refuses two ranks on one GPU) trains
#      under traceml with steps counted, and communication says "not measured"
#      rather than a host time that is not the GPU's (NCCL makes streams wait,
#      not the host): no communication phase, in flight null; and the compute
#      stream's wait on DDP's all-reduce is timed with CUDA events on the sampled
#      steps (gpu_communication_ms), which the rules read (not COMMUNICATION-BOUND here).
#   6. MFU: a bf16 (autocast) transformer step's FLOPs per step, counted by
#      torch's FLOP counter in one step, equal the hand count (3 x the forward
#      matmuls) within 2 %, the dtype is bf16, the peak is the table's for this
#      device name, and the summary's MFU equals the hand computation (hand
#      FLOPs over the script's own step time over the peak) within 5 %.
#   7. A profiler capture on CUDA: `traceml capture` of a live 1-GPU run profiles 2
#      steps with CUDA activities: the operators carry device time, the trace holds
#      the GPU's kernels, and the run ends 0 with every step stored.
#   8. (run and checked after 5). NCCL against the check's own CUDA events: a comm hook
#      puts a known wait (a torch.cuda._sleep kernel) before each bucket's all-reduce
#      on a side stream; DDP's exposed wait as traceml stores it within 10 % of the
#      check's events (last bucket ready to backward's return), in a mostly exposed
#      and a mostly overlapped case; in flight likewise once traceml stores it; the
#      exposed case's verdict COMMUNICATION-BOUND (from that wait), the hidden one's not.
#
# GPU_CHECK_ONLY=nccl,truth (the sections' names: healthy, input_bound, nccl, truth,
# mfu, capture) runs and checks those alone: a rerun of one part inside a short lease.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/traceml-gpu-check}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
ONLY="${GPU_CHECK_ONLY:-}"
wanted() {  # wanted SECTION: whether GPU_CHECK_ONLY (empty: all) names it
    [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]
}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

cat > "$OUT/cuda_train.py" <<'PY'
import sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Data(Dataset):
    def __init__(self, sleep_s, steps): self.sleep_s, self.steps = sleep_s, steps
    def __len__(self): return self.steps * 64
    def __getitem__(self, i):
        if self.sleep_s: time.sleep(self.sleep_s)
        return torch.randn(1024), i % 10

sleep_s, steps = float(sys.argv[1]), int(sys.argv[2])
spike_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                      nn.Linear(4096, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(DataLoader(Data(sleep_s, steps), batch_size=64, pin_memory=True)):
    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    opt.zero_grad(set_to_none=True)
    if step == spike_step:  # a transient 512 MiB on one step, freed at once
        spike = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
        del spike
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

cat > "$OUT/nccl_truth.py" <<'PY'
# DDP on NCCL with a known wait on the collective's path, and the check's own CUDA
# events around it.  One rank has no network (NCCL refuses two ranks on one GPU, and
# one rank's all-reduce is a local copy), so a comm hook puts a torch.cuda._sleep
# kernel of a set length before each bucket's all-reduce, on a side stream the
# all-reduce follows: the compute stream waits for it as it would for the wire.
import json, sys, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("nccl")
torch.cuda.set_device(0)
out, rows, wire_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
W, STEPS = 4096, 50
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(*[nn.Linear(W, W) for _ in range(4)]).cuda(), device_ids=[0],
    bucket_cap_mb=65)  # about a layer a bucket
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(1_000_000)
a.record(); torch.cuda._sleep(20_000_000); b.record(); b.synchronize()
cycles = int(wire_ms * 20_000_000 / a.elapsed_time(b))
side = torch.cuda.Stream()
ready, streams = [], {}

def hook(state, bucket):
    cur = torch.cuda.current_stream()
    streams.setdefault("hook", cur.cuda_stream)
    event = torch.cuda.Event(enable_timing=True)
    event.record(cur)  # this bucket's gradients are computed
    ready.append(event)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda f: f.value()[0])

def final_stream(grad):  # which stream autograd's final callbacks run on
    torch.autograd.Variable._execution_engine.queue_callback(
        lambda: streams.setdefault("final_callback", torch.cuda.current_stream().cuda_stream))

model.register_comm_hook(None, hook)
opt = torch.optim.SGD(model.parameters(), lr=1e-9)
x = torch.randn(rows, W, device="cuda")
streams["caller"] = torch.cuda.current_stream().cuda_stream
pending = []
for step in range(STEPS):
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    if step < 3:
        loss.register_hook(final_stream)
    loss.backward()
    done = torch.cuda.Event(enable_timing=True)
    done.record()  # backward() returned: DDP's wait and its copies are queued
    pending.append((ready[:], done))
    ready.clear()
    opt.step()
torch.cuda.synchronize()
json.dump({"exposed": [r[-1].elapsed_time(d) for r, d in pending],
           "in_flight": [r[0].elapsed_time(d) for r, d in pending],
           "buckets": [len(r) for r, _ in pending], "wire_ms": wire_ms,
           "streams": streams}, open(out, "w"))
dist.destroy_process_group()
PY

cat > "$OUT/mfu_train.py" <<'PY'
# A bf16 transformer (attention written out in matmuls, so the hand count is exact).
import json, math, sys, time, torch
from torch import nn
B, T, D, H, L = 8, 512, 1024, 16, 4
dev = "cuda" if torch.cuda.is_available() else "cpu"

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).split(D, dim=-1)
        q, k, v = (z.reshape(B, T, H, D // H).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(D // H)).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.down(torch.relu(self.up(self.n2(x))))

model = nn.Sequential(*[Block() for _ in range(L)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(B, T, D, device=dev)
times = []
for step in range(int(sys.argv[2]) if len(sys.argv) > 2 else 60):
    t = time.perf_counter()
    with torch.autocast(dev, dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dev == "cuda":
        torch.cuda.synchronize()  # the script's own timer sees the GPU's time
    times.append(time.perf_counter() - t)
tokens = B * T
forward = L * (2 * tokens * D * 3 * D + 4 * B * T * T * D + 2 * tokens * D * D
               + 2 * 2 * tokens * D * 4 * D)
name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
json.dump({"times": times, "flops": 3 * forward, "device_name": name}, open(sys.argv[1], "w"))
PY

# Each run's failure is reported by the checks below (FAIL), not by stopping here.
run() {  # run SECTION SESSION ARGS...: traceml run, its output in $OUT/SESSION.txt
    wanted "$1" || return 0
    local session="$2"; shift 2
    "$PY" -m traceml run --logs-dir "$OUT/logs" --session-id "$session" --sample-interval 0.5 \
        "$@" > "$OUT/$session.txt" 2>&1 || echo "traceml run $session: exit $?" | tee -a "$OUT/$session.txt"
}
run mfu mfu "$OUT/mfu_train.py" "$OUT/mfu_own.json"
run nccl nccl "$OUT/nccl_train.py"
# DDP's wait against the check's own events: a few big buckets after little compute
# (the wait mostly exposed), and many buckets under a long backward (mostly hidden).
run truth truth_exposed "$OUT/nccl_truth.py" "$OUT/truth_exposed.json" 64 4
run truth truth_overlap "$OUT/nccl_truth.py" "$OUT/truth_overlap.json" 4096 1
run healthy healthy "$OUT/cuda_train.py" 0 200 100
run input_bound input "$OUT/cuda_train.py" 0.0005 60

if wanted capture; then
# A live run long enough to be asked for a capture by hand.
"$PY" -m traceml run --logs-dir "$OUT/logs" --session-id capture --sample-interval 0.5 \
    "$OUT/cuda_train.py" 0 6000 > "$OUT/capture.txt" 2>&1 &
RUN_PID=$!
"$PY" - "$OUT/logs/capture/telemetry.sqlite" <<'PY' || true  # the checks below say FAIL
import os, sqlite3, sys, time
deadline = time.time() + 120
while time.time() < deadline:
    try:
        if sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True).execute(
                "SELECT count(*) FROM steps").fetchone()[0] >= 50:
            sys.exit(0)
    except sqlite3.Error:
        pass
    time.sleep(0.5)
sys.exit("no steps stored in 120 s")
PY
"$PY" -m traceml capture "$OUT/logs/capture" --rank 0 --steps 2 --wait 120 \
    > "$OUT/capture_cli.txt" 2>&1 || true
wait "$RUN_PID" || true
fi

"$PY" - "$OUT/logs" "$ONLY" <<'PY'
import json, sqlite3, sys
logs = sys.argv[1]
only = [name for name in sys.argv[2].split(",") if name]
failed = []

def check(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail else ""))
    if not ok:
        failed.append(name)

def healthy():
    db = sqlite3.connect(f"{logs}/healthy/telemetry.sqlite")
    rows = db.execute("SELECT step, gpu_forward_ms, gpu_backward_ms, gpu_optimizer_ms, "
                      "peak_allocated_bytes, peak_reserved_bytes FROM steps ORDER BY step").fetchall()
    timed = [r for r in rows if r[1] is not None]
    steps = [r[0] for r in timed]
    med = lambda i: sorted(r[i] for r in timed)[len(timed) // 2]
    check("GPU phase times on every one of steps 1-24", steps[:24] == list(range(1, 25)),
          f"{len(timed)}/{len(rows)} steps timed; median GPU fwd/bwd/opt ms "
          f"{med(1):.3f}/{med(2):.3f}/{med(3):.3f}" if timed else "none")
    later = [s for s in steps if s >= 25]
    # A timed step costs 5 event records and an allocator read, over the 20 µs a step
    # may add: so not every step is timed.
    check("then on a sample (at least 1 in 64, not all)",
          (len(rows) - 25) // 64 <= len(later) < len(rows) - 25,
          f"{len(later)} of {len(rows) - 25} steps after the first 25")
    check("GPU times are positive", all(r[1] > 0 and r[2] > 0 and r[3] > 0 for r in timed))
    read = [r for r in rows if r[4] is not None]
    check("peaks read on the timed steps only (and the first and last)",
          {r[0] for r in read} <= {0, rows[-1][0], *steps} and set(steps) <= {r[0] for r in read}
          and all(r[5] >= r[4] for r in read), f"{len(read)} steps carry peaks")
    spike = [r for r in read if r[0] >= 100][:1]
    check("a 512 MiB spike on step 100 is in the next read peak, not before",
          bool(spike) and spike[0][4] >= 512 * 2**20
          and all(r[4] < 512 * 2**20 for r in read if r[0] < 100),
          f"step {spike[0][0]}: {spike[0][4] / 2**20:.0f} MiB" if spike else "no peak after 100")
    summary = json.load(open(f"{logs}/healthy/final_summary.json"))
    scope, row = summary["step_time"]["scope"], summary["step_time"]["ranks"][0]
    # The window's timed steps, less the one the FLOP counter ran in (left out of the window).
    counted = {s for (s,) in db.execute("SELECT step FROM steps WHERE flops_counted = 1")}
    in_window = [s for s in steps if scope["first_step"] <= s <= scope["last_step"]
                 and s not in counted]
    check("summary counts the timed steps and takes GPU time from them",
          row["num_gpu_timed_steps"] == len(in_window) == (row["gpu_ms"] or {}).get("count"),
          f"num_gpu_timed_steps {row['num_gpu_timed_steps']} of {row['num_steps']}, "
          f"gpu_ms mean {(row['gpu_ms'] or {}).get('mean')}")
    card = open(f"{logs}/healthy/final_summary.txt").read()
    check("card has the GPU time line", "GPU time: median/worst" in card)
    proc = db.execute("SELECT device_allocated_bytes, device_reserved_bytes, device_total_bytes "
                      "FROM process").fetchall()
    # The first sample is taken at the agent's start, before the script made CUDA.
    check("process samples carry device memory once CUDA is up",
          len(proc) >= 2 and all(p[2] for p in proc[1:]),
          f"{len(proc)} samples, total {proc[-1][2] if proc else None}")
    gpus = [json.loads(g) for (g,) in db.execute("SELECT gpus FROM system")]
    check("NVML system samples", gpus and all(g for g in gpus),
          f"{len(gpus)} samples, first {gpus[0] if gpus else None}")
    check("summary device is cuda", summary["meta"]["device"] == "cuda")


def input_bound():
    label = json.load(open(f"{logs}/input/final_summary.json"))["step_time"]["diagnosis"]["label"]
    check("input-bound CUDA run diagnosed INPUT-BOUND", label == "INPUT-BOUND", label)


def nccl():
    nccl = sqlite3.connect(f"{logs}/nccl/telemetry.sqlite")
    steps = nccl.execute("SELECT num_communication, communication_ms, collective_ms, "
                         "backward_ms FROM steps").fetchall()
    check("NCCL DDP steps counted", len(steps) >= 39, f"{len(steps)} steps")
    check("NCCL: no host time passed off as communication",
          all(s[0] == 0 and s[1] == 0 for s in steps),
          f"median backward {sorted(s[3] for s in steps)[len(steps)//2]:.3f} ms" if steps else "none")
    check("NCCL: in flight not measured on CUDA (null)", all(s[2] is None for s in steps))
    gcomm = [v for (v,) in nccl.execute("SELECT gpu_communication_ms FROM steps") if v is not None]
    check("NCCL: DDP's wait timed on the GPU on the sampled steps (gpu_communication_ms)",
          len(gcomm) >= 20 and all(v >= 0 for v in gcomm),
          f"{len(gcomm)} timed steps, median {sorted(gcomm)[len(gcomm) // 2]:.3f} ms" if gcomm
          else "none")
    step_time = json.load(open(f"{logs}/nccl/final_summary.json"))["step_time"]
    labels = [f["label"] for f in step_time["findings"]]
    waited = step_time["ranks"][0]["gpu_communication_ms"]
    check("NCCL: the summary carries the GPU's wait; a local copy is not COMMUNICATION-BOUND",
          waited is not None and "COMMUNICATION-BOUND" not in labels,
          f"gpu_communication_ms {waited}; findings: {'; '.join(labels)}")


def truth():
    # DDP's wait on NCCL against the check's own events (nccl_truth.py): the compute
    # stream's wait is last bucket ready -> backward returned; in flight, first -> that.
    med = lambda xs: sorted(xs)[len(xs) // 2]
    for case in ("exposed", "overlap"):
        own = json.load(open(f"{logs}/../truth_{case}.json"))
        db = sqlite3.connect(f"{logs}/truth_{case}/telemetry.sqlite")
        cols = {r[1] for r in db.execute("PRAGMA table_info(steps)")}
        rows = db.execute("SELECT step, gpu_communication_ms, gpu_backward_ms FROM steps "
                          "WHERE gpu_communication_ms IS NOT NULL AND step >= 3").fetchall()
        ours, theirs = med([r[1] for r in rows]), med(own["exposed"][3:])
        check(f"NCCL {case}: DDP's exposed wait within 10% of the check's CUDA events",
              abs(ours / theirs - 1) < 0.10,
              f"traceml {ours:.3f} ms vs events {theirs:.3f} ms over {len(rows)} timed steps; "
              f"injected {own['wire_ms']} ms a bucket, {med(own['buckets'])} buckets, "
              f"in flight {med(own['in_flight'][3:]):.3f} ms; backward (GPU, traceml) "
              f"{med([r[2] for r in rows]):.3f} ms; streams {own['streams']}")
        # The rules read that wait on CUDA: the mostly exposed case is
        # COMMUNICATION-BOUND; the mostly hidden one (about 1 of 20 ms) is not.
        step_time = json.load(open(f"{logs}/truth_{case}/final_summary.json"))["step_time"]
        comm = [f for f in step_time["findings"] if f["kind"] == "COMMUNICATION_BOUND"]
        verdict = step_time["diagnosis"]["kind"]
        check(f"NCCL {case}: the verdict reads the GPU's wait",
              (verdict == "COMMUNICATION_BOUND") if case == "exposed" else not comm,
              f"verdict {verdict}; " + (comm[0]["why"] if comm else "no COMMUNICATION-BOUND")
              + "; " + "; ".join(f["label"] for f in step_time["findings"]))
        if "gpu_collective_ms" in cols:
            flight = [v for (v,) in db.execute("SELECT gpu_collective_ms FROM steps WHERE "
                                               "gpu_collective_ms IS NOT NULL AND step >= 3")]
            check(f"NCCL {case}: in flight within 10% of the check's CUDA events",
                  bool(flight) and abs(med(flight) / med(own["in_flight"][3:]) - 1) < 0.10,
                  f"traceml {med(flight) if flight else None} ms vs events "
                  f"{med(own['in_flight'][3:]):.3f} ms")



def mfu():
    from traceml.diagnosis.peaks import peak_for
    own = json.load(open(f"{logs}/../mfu_own.json"))
    tp = json.load(open(f"{logs}/mfu/final_summary.json"))["throughput"]
    row, scope = tp["ranks"][0], tp["scope"]
    counted = {s for (s,) in sqlite3.connect(f"{logs}/mfu/telemetry.sqlite").execute(
        "SELECT step FROM steps WHERE flops_counted = 1")}
    window = [s for s in range(scope["first_step"], scope["last_step"] + 1) if s not in counted]
    peak = peak_for(own["device_name"], "bf16").tflops
    hand_tflops = own["flops"] * len(window) / sum(own["times"][s] for s in window) / 1e12
    hand_mfu = 100 * hand_tflops / peak if peak else None
    check("MFU: FLOPs per step equal the hand count (2%)",
          row["flops_per_step"] is not None and abs(row["flops_per_step"] / own["flops"] - 1) < 0.02,
          f"counted {row['flops_per_step']}, hand {own['flops']}")
    check("MFU: the step ran in bf16", row["dtype"] == "bf16", str(row["dtype"]))
    check("MFU: the table's peak for this device", peak is not None and row["peak_tflops"] == peak,
          f"{own['device_name']}: {row['peak_tflops']} TFLOP/s ({tp['job']['peak_source']})")
    check("MFU: equals the hand computation (5%)",
          hand_mfu is not None and row["mfu_pct"] is not None
          and abs(row["mfu_pct"] / hand_mfu - 1) < 0.05,
          f"traceml {row['mfu_pct']}% vs hand {hand_mfu}% "
          f"({row['achieved_tflops']} vs {hand_tflops:.1f} TFLOP/s)")


def capture():
    import gzip
    summary = json.load(open(f"{logs}/capture/final_summary.json"))
    caps = summary["captures"]
    check("capture: traceml capture asked a live CUDA run", len(caps) == 1 and
          caps[0]["trigger"] == "manual", open(f"{logs}/../capture_cli.txt").read()[-300:])
    if caps:
        c = caps[0]
        check("capture: 2 steps profiled with CUDA activities", c["num_steps"] == 2 and c["device"],
              f"{c['num_steps']} steps, device {c['device']}, notes {c['notes']}")
        check("capture: the top operator has device time",
              bool(c["operators"]) and (c["operators"][0]["suspect"] or {}).get("ms", 0) > 0,
              str(c["operators"][:2]))
        events = json.load(gzip.open(c["traces"][0]["path"]))["traceEvents"] if c["traces"] else []
        check("capture: the trace holds the GPU's kernels",
              any(e.get("cat") == "kernel" for e in events), f"{len(events)} events")
    run_steps = sqlite3.connect(f"{logs}/capture/telemetry.sqlite").execute(
        "SELECT count(*) FROM steps").fetchone()[0]
    check("capture: the run ended 0 with every step stored",
          summary["meta"]["exit_code"] == 0 and run_steps == 6000, f"{run_steps} steps")


for section in (healthy, input_bound, nccl, truth, mfu, capture):
    if only and section.__name__ not in only:
        continue
    try:
        section()
    except Exception as exc:  # a run that failed leaves its files out
        check(f"{section.__name__}: the checks ran", False, f"{type(exc).__name__}: {exc}")
sys.exit(1 if failed else 0)
PY
