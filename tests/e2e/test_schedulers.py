"""Launches a scheduler makes: two `traceml run` launchers on loopback given exactly
the environment the scheduler gives its tasks, and no option (SLURM's srun; a
Kubernetes PyTorchJob's pods, read from its manifest) -> one summary, on node 0."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from tests import schedulers
from tests.conftest import read_summary, script
from tests.e2e.test_nodes import free_ports
from traceml.launcher.slurm import SlurmStep


def _free_everywhere(*ports: int) -> bool:
    held: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        for sock in held:
            sock.close()


def free_job_id() -> int:
    """A SLURM job id whose ports (rendezvous, collector, its join check) are free here."""
    for _ in range(200):
        job_id = random.randrange(1, 5000)
        port = SlurmStep(job_id, 0, 2, 0, "", None).master_port
        if _free_everywhere(port, port + 2, port + 3):
            return job_id
    raise AssertionError("no free ports")


def base_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without anything a scheduler or traceml set."""
    evidence = tmp_path / "evidence"
    evidence.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "TRACEML_", "PET_", "MASTER_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "EVIDENCE_DIR": str(evidence)}


def launch(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "traceml", *argv], env=env, cwd=cwd,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            out.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


def assert_one_summary_on_node_0(results: list[tuple[int, str, str]], node0_logs: Path,
                                 node1_logs: Path | None, session_id: str, world: int) -> None:
    """Both launchers exit 0; node 0 wrote and printed the one summary, of every rank of
    both nodes; node 1 printed none (and wrote none in its own ``node1_logs``)."""
    (code0, out0, err0), (code1, out1, err1) = results
    assert (code0, code1) == (0, 0), err0[-3000:] + err1[-3000:]
    summary = read_summary(node0_logs / session_id)
    assert summary is not None, err0[-3000:]
    assert summary["meta"]["world_size"] == world and summary["meta"]["missing_ranks"] == []
    assert {n["node_rank"] for n in summary["meta"]["nodes"]} == {0, 1}
    assert sorted(summary["step_time"]["scope"]["ranks"]) == list(range(world))
    assert "TraceML Run Summary" in out0 and "TraceML Run Summary" not in out1
    assert "node 0 writes the summary" in err1
    if node1_logs is not None:
        assert not list(node1_logs.glob("*/final_summary.json"))


def test_srun_two_nodes_with_no_options(tmp_path: Path) -> None:
    """srun's variables for a two-node job (the nodes 127.0.0.1 and 127.0.0.2) and
    the secret the batch script exported: `traceml run allreduce.py`, nothing else."""
    job_id = free_job_id()
    hosts = ["127.0.0.1", "127.0.0.2"]
    procs = []
    for node in (0, 1):
        env = {**base_env(tmp_path), "TRACEML_SECRET": "exported by the batch script",
               **schedulers.srun_env(node, hosts, "127.0.0.[1-2]", job_id=job_id)}
        procs.append(launch(["run", script("allreduce.py")], env, tmp_path / f"node{node}"))
    results = finish(procs)
    assert_one_summary_on_node_0(results, tmp_path / "node0" / "logs",
                                 tmp_path / "node1" / "logs", f"slurm-{job_id}", 2)
    assert "inside a SLURM step: --nnodes=2 --node-rank=1 --master-addr=127.0.0.1" in results[1][2]


FAKE_SRUN = """#!{python}
# srun for this test: its options are dropped; the command runs once per node of
# the job, each with the variables srun would set for it (from SRUN_ENVS, a JSON list).
import json, os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
envs = json.load(open(os.environ["SRUN_ENVS"]))
procs = [subprocess.Popen(args, env={{**os.environ, **env}}) for env in envs]
sys.exit(max(p.wait() for p in procs))
"""


def test_the_example_sbatch_runs_as_submitted(tmp_path: Path) -> None:
    """examples/slurm/train.sbatch, run as SLURM's batch step runs it, with an srun that
    starts its command on two loopback nodes with srun's variables."""
    root = Path(__file__).resolve().parents[2]
    job_id = free_job_id()
    hosts = ["127.0.0.1", "127.0.0.2"]
    node_envs = [schedulers.srun_env(n, hosts, "127.0.0.[1-2]", job_id=job_id,
                                     SLURM_SUBMIT_DIR=str(tmp_path)) for n in (0, 1)]
    batch_env = {k: v for k, v in node_envs[0].items() if not k.startswith("SLURM_STEP")}
    (tmp_path / "srun.json").write_text(__import__("json").dumps(node_envs))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    env = {**base_env(tmp_path), **batch_env, "HOME": str(tmp_path),
           "SRUN_ENVS": str(tmp_path / "srun.json"),
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                    os.environ["PATH"]])}
    proc = subprocess.run(["bash", str(root / "examples" / "slurm" / "train.sbatch")], env=env,
                          cwd=root, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "logs" / f"slurm-{job_id}")
    assert summary is not None and summary["meta"]["world_size"] == 2
    assert {n["node_rank"] for n in summary["meta"]["nodes"]} == {0, 1}
    assert summary["step_time"]["scope"]["num_steps"] >= 400, summary["step_time"]["scope"]
    assert proc.stdout.count("TraceML Run Summary") == 1
    assert not list((tmp_path / ".traceml").iterdir())  # the job's secret file is gone


ROOT = Path(__file__).resolve().parents[2]
SECRETS = {("traceml-secret", "secret"): "the Secret's value"}


def run_pods(tmp_path: Path, pods: list[schedulers.Pod]) -> list[tuple[int, str, str]]:
    """Start each pod's command (``traceml run ...``) with its environment, in its
    working directory; wait for all."""
    procs = []
    for pod in pods:
        assert pod.argv[:2] == ["traceml", "run"], pod.argv
        env = {**base_env(tmp_path), **pod.env}
        procs.append(launch(["run", *pod.argv[2:]], env, Path(pod.working_dir)))
    return finish(procs)


def local_paths(tmp_path: Path) -> dict[str, str]:
    """The volume (one folder both pods mount, as a ReadWriteMany claim) and the image's
    working directory (this repository's examples/, where train.py is)."""
    return {"/traceml": str(tmp_path / "volume"), "/workspace": str(ROOT / "examples")}


def test_pytorchjob_pods_with_no_other_options(tmp_path: Path) -> None:
    """Both pods of examples/k8s/pytorchjob.yaml: the command, args and env the manifest
    gives them, with the training operator's variables; only paths, the master's
    service name and ports are this machine's."""
    job = schedulers.manifest("pytorchjob.yaml")
    name = job["metadata"]["name"]
    rendezvous, collector = free_ports()
    pods = []
    for replica in ("Master", "Worker"):
        (container,) = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
        labels = {"training.kubeflow.org/job-name": name,
                  "training.kubeflow.org/replica-type": replica.lower(),
                  "training.kubeflow.org/replica-index": "0"}
        pod = schedulers.pod(container, schedulers.pytorchjob_operator_env(job, replica, 0),
                             labels, SECRETS)
        pods.append(schedulers.on_this_machine(
            pod, local_paths(tmp_path), {f"{name}-master-0": "127.0.0.1"},
            {23456: rendezvous, 29765: collector}))
    assert [p.mounts for p in pods] == [[str(tmp_path / "volume")]] * 2
    results = run_pods(tmp_path, pods)
    assert_one_summary_on_node_0(results, tmp_path / "volume" / "logs", None, name, 4)


def test_jobset_pods_with_no_other_options(tmp_path: Path) -> None:
    """Both pods of examples/k8s/jobset.yaml's Indexed Job, with the Job controller's
    completion index and JobSet's labels; only paths, DNS names and ports are local."""
    jobset = schedulers.manifest("jobset.yaml")
    name = jobset["metadata"]["name"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    rendezvous, collector = free_ports()
    pods = []
    for index in range(job["completions"]):
        labels = {"jobset.sigs.k8s.io/jobset-name": name,
                  "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                  "jobset.sigs.k8s.io/job-index": "0"}
        pod = schedulers.pod(container, {"JOB_COMPLETION_INDEX": str(index)}, labels, SECRETS)
        pods.append(schedulers.on_this_machine(
            pod, local_paths(tmp_path), {f"{name}-{replicated['name']}-0-0.{name}": "127.0.0.1"},
            {29500: rendezvous, 29765: collector}))
    results = run_pods(tmp_path, pods)
    assert_one_summary_on_node_0(results, tmp_path / "volume" / "logs", None, name, 4)
