"""What schedulers put in a task's environment, for tests: ``srun``'s variables for
a job step (the ones traceml reads among them); a Kubernetes pod's command line and
environment, made from a manifest as its controllers and the kubelet make them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


def srun_env(node_id: int, hosts: list[str], nodelist: str, job_id: int = 4242,
             **extra: str) -> dict[str, str]:
    """The SLURM variables srun sets for its task on node ``node_id`` of a job
    submitted with ``--nodes=N --ntasks-per-node=1 --cpus-per-task=2`` (N =
    ``len(hosts)``), step 0;
    ``nodelist`` is ``hosts`` in SLURM's compact form."""
    num = str(len(hosts))
    return {
        "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_NNODES": num,
        "SLURM_JOB_NUM_NODES": num, "SLURM_STEP_NUM_NODES": num, "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist, "SLURM_NTASKS": num,
        "SLURM_NPROCS": num, "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": f"1(x{num})",
        "SLURM_STEP_NUM_TASKS": num, "SLURM_STEP_TASKS_PER_NODE": f"1(x{num})",
        "SLURMD_NODENAME": hosts[node_id], "SLURM_TOPOLOGY_ADDR": hosts[node_id],
        "SLURM_CPUS_ON_NODE": "2", "SLURM_CPUS_PER_TASK": "2", "SLURM_JOB_CPUS_PER_NODE": f"2(x{num})",
        "SLURM_SUBMIT_HOST": hosts[0], "SLURM_CLUSTER_NAME": "test", "SLURM_JOB_PARTITION": "cpu",
        **extra,
    }


EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "k8s"


def manifest(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return data


@dataclass(frozen=True)
class Pod:
    """What the kubelet would run: the container's argv, its environment (on top of
    the image's), and its working directory and volumes, as paths in the container."""

    argv: list[str]
    env: dict[str, str]
    working_dir: str
    mounts: list[str]


def pytorchjob_operator_env(job: Mapping[str, Any], replica: str, index: int) -> dict[str, str]:
    """The variables Kubeflow's training operator (v1, controller.v1/pytorch/envvar.go
    and master.go) appends to the container of pod ``index`` of ``replica``."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    nproc = job["spec"].get("nprocPerNode")
    total = sum(int(s["replicas"]) for s in specs.values())
    master = specs["Master"]["template"]["spec"]["containers"][0]
    (port,) = [p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port"]
    rank = index + (1 if replica == "Worker" else 0)
    env = {"PYTHONUNBUFFERED": "0", "MASTER_PORT": str(port),
           "MASTER_ADDR": f"{job['metadata']['name']}-master-0",
           "WORLD_SIZE": str(total * int(nproc or 1)), "RANK": str(rank)}
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = nproc
    return {**env, "PET_NODE_RANK": str(rank), "PET_NNODES": str(total)}


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values ($$ is a '$')."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


POD_FIELDS = {"metadata.name": "traceml-train-pod-0", "metadata.namespace": "training"}
"""The pod's own name and namespace, as the downward API gives them."""


def _value(item: Mapping[str, Any], labels: Mapping[str, str], annotations: Mapping[str, str],
           secrets: Mapping[tuple[str, str], str]) -> str:
    if "value" in item:
        return str(item["value"])
    source = item["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return secrets[(ref["name"], ref["key"])]
    path = source["fieldRef"]["fieldPath"]
    if path in POD_FIELDS:
        return POD_FIELDS[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    assert match, f"fieldRef {path} not modelled here"
    return (labels if match.group(1) == "labels" else annotations)[match.group(2)]


def pod(container: Mapping[str, Any], added_env: Mapping[str, str], labels: Mapping[str, str],
        secrets: Mapping[tuple[str, str], str],
        annotations: Mapping[str, str] | None = None) -> Pod:
    """The pod the kubelet starts for ``container``: its env list (values, labels and
    annotations through the downward API, Secrets), then what the controllers added,
    and every $(VAR) in command and args expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        env[item["name"]] = _expand(_value(item, labels, annotations or {}, secrets), env)
    env.update(added_env)
    argv = [_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    return Pod(argv, env, container.get("workingDir", "/"),
               [m["mountPath"] for m in container.get("volumeMounts", [])])


def on_this_machine(pod: Pod, paths: Mapping[str, str], hosts: Mapping[str, str],
                    ports: Mapping[int, int]) -> Pod:
    """``pod`` run here: container paths, cluster DNS names and ports replaced (the
    only changes), in argv and environment values alike."""
    def local(text: str) -> str:
        for old, new in [*paths.items(), *hosts.items()]:
            text = text.replace(old, new)
        return re.sub(r"(?<![\d.])(\d{4,5})(?![\d.])",
                      lambda m: str(ports.get(int(m.group(1)), m.group(1))), text)
    return Pod([local(a) for a in pod.argv], {k: local(v) for k, v in pod.env.items()},
               local(pod.working_dir), [local(m) for m in pod.mounts])
