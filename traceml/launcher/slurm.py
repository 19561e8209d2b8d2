"""``traceml run`` inside ``srun``: the options torchrun would need, from SLURM's
environment (launcher side).  The only module that reads ``SLURM_*`` variables.

In a job step (``srun``), one launcher per node, the launcher fills what the
user did not give:

==========================  =================================================
``--nnodes``                ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``)
``--node-rank``             this node's index in the step: ``SLURMD_NODENAME``
                            in the step's node list, else ``SLURM_NODEID``
``--master-addr``           the first host of ``SLURM_STEP_NODELIST`` (else
                            ``SLURM_JOB_NODELIST``), compact form expanded
``--master-port``           ``10000 + 4 * ((job id + 1777 * step id) mod 5000)``:
``--aggregator-port``       two jobs, or two steps of one job, sharing a node
                            rarely collide; the collector's port is the
                            rendezvous port + 2 (its join check +3)
``--nproc-per-node``        ``SLURM_GPUS_ON_NODE`` when the node has GPUs,
                            else ``SLURM_NTASKS_PER_NODE``
``--session-id``            ``slurm-<SLURM_JOB_ID>``, ``.<step>`` after the
                            job's first step (``SLURM_STEP_ID``) and ``.r<n>``
                            after a requeue (``SLURM_RESTART_COUNT``)
==========================  =================================================

A step on one node gets neither port: the launcher picks free ones, as it
does outside SLURM, so steps that share the node never collide.  Options the
user gives win: the filled ones are put before the user's arguments, and the
last of an option wins in argparse.  Outside a step (no ``SLURM_STEP_ID``,
e.g. the batch script itself) nothing is filled, and a job of several nodes
gets a hint to run ``srun``.  A heterogeneous job (``SLURM_HET_SIZE``) gets
nothing filled either, and a hint: its components each number their nodes
from 0.  A step that starts several launchers on a node
(``SLURM_STEP_TASKS_PER_NODE``) is refused: `traceml run` starts the node's
ranks itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from traceml.errors import UsageError

RUN_HINT = "run one traceml per node: srun --ntasks-per-node=1 traceml run ..."
HET_HINT = ("traceml: a heterogeneous SLURM job: no option is filled from SLURM's variables "
            "(each component numbers its nodes from 0); give --nnodes, --node-rank, "
            "--master-addr, --master-port and --session-id")
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_range(text: str, nodelist: str) -> list[str]:
    """``01-03`` -> ``01 02 03`` (the lower bound's digits give the padding), ``7`` -> ``7``."""
    match = _RANGE_RE.match(text.strip())
    if match is None:
        raise UsageError(f"traceml run: cannot read SLURM's node list {nodelist!r}: "
                         f"{text!r} is not a number or a range")
    low, high = match.group(1), match.group(2) or match.group(1)
    if int(high) < int(low):
        raise UsageError(f"traceml run: cannot read SLURM's node list {nodelist!r}: "
                         f"range {text!r} runs backwards")
    return [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    """One host pattern with any number of bracket groups: ``r[1-2]n[01,03]``
    -> ``r1n01 r1n03 r2n01 r2n03``."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise UsageError(f"traceml run: cannot read SLURM's node list {nodelist!r}: "
                             "unbalanced ']'")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise UsageError(f"traceml run: cannot read SLURM's node list {nodelist!r}: "
                         "unbalanced '['")
    head, body, rest = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    values = [v for part in body.split(",") for v in _expand_range(part, nodelist)]
    tails = _expand_host(rest, nodelist)
    return [head + value + tail for value in values for tail in tails]


def _split_top_level(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order (``scontrol show hostnames``):
    ``gpu-a[1,3-5],gpu-b7`` -> ``gpu-a1 gpu-a3 gpu-a4 gpu-a5 gpu-b7``."""
    hosts = [h for item in _split_top_level(nodelist) for h in _expand_host(item, nodelist)]
    if not hosts:
        raise UsageError(f"traceml run: SLURM's node list is empty ({nodelist!r})")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's tasks from SLURM's ``2(x3),1`` form (2 on each of 3 nodes, then 1)."""
    index = 0
    for item in tasks_per_node.split(","):
        match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item.strip())
        if match is None:
            return 1  # a form SLURM does not write: do not refuse the run over it
        index += int(match.group(2) or 1)
        if node_id < index:
            return int(match.group(1))
    return 1


@dataclass(frozen=True)
class SlurmStep:
    """The job step this launcher runs in, as SLURM's environment says."""

    job_id: int
    step_id: int
    num_nodes: int
    node_id: int
    first_host: str
    nproc_per_node: int | None  # None: SLURM does not say; torchrun's default
    restart_count: int = 0  # SLURM_RESTART_COUNT: the job was requeued this many times

    @property
    def session_id(self) -> str:
        return (f"slurm-{self.job_id}" + (f".{self.step_id}" if self.step_id else "")
                + (f".r{self.restart_count}" if self.restart_count else ""))

    @property
    def master_port(self) -> int:
        return 10000 + 4 * ((self.job_id + 1777 * self.step_id) % 5000)

    def launch_options(self) -> list[str]:
        """The options to put before the user's own."""
        options = [f"--nnodes={self.num_nodes}", f"--node-rank={self.node_id}"]
        if self.num_nodes > 1:  # one node: free ports, picked by the launcher
            options += [f"--master-addr={self.first_host}", f"--master-port={self.master_port}",
                        f"--aggregator-port={self.master_port + 2}"]
        options.append(f"--session-id={self.session_id}")
        if self.nproc_per_node is not None:
            options.append(f"--nproc-per-node={self.nproc_per_node}")
        return options


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int (None: none is set)."""
    for name in names:
        text = environ.get(name, "").strip()
        if text:
            try:
                return int(text.split("(")[0].split(",")[0])
            except ValueError:
                raise UsageError(f"traceml run: SLURM variable {name}={text!r} is not a "
                                 "number") from None
    return None


def step_from_env(environ: Mapping[str, str]) -> SlurmStep | None:
    """The SLURM step this process runs in; None outside one (or outside SLURM)."""
    job_id = _int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    step_id = _int(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    if job_id is None or step_id is None or environ.get("SLURM_HET_SIZE"):
        return None
    num_nodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST") or "")
    if num_nodes > 1 and not nodelist:
        raise UsageError("traceml run: SLURM says the step has several nodes but sets no "
                         "SLURM_JOB_NODELIST; pass --master-addr")
    hosts = expand_nodelist(nodelist) if nodelist else ["127.0.0.1"]
    node_id = _node_index(environ, hosts)
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    if tasks and _tasks_on_node(tasks, node_id) > 1:
        raise UsageError(f"traceml run: this SLURM step starts {_tasks_on_node(tasks, node_id)} "
                         f"tasks on this node, each a traceml launcher; {RUN_HINT}")
    gpus = _int(environ, "SLURM_GPUS_ON_NODE")
    nproc = gpus if gpus else _int(environ, "SLURM_NTASKS_PER_NODE")
    return SlurmStep(job_id=job_id, step_id=step_id,
                     restart_count=_int(environ, "SLURM_RESTART_COUNT") or 0,
                     num_nodes=num_nodes, node_id=node_id, first_host=hosts[0],
                     nproc_per_node=nproc)


def hint(environ: Mapping[str, str]) -> str | None:
    """A line for a launcher in a SLURM job that fills nothing where the user likely
    meant it to: a heterogeneous job, or the batch script of a job of several nodes
    (outside ``srun``: this launcher would run one node's ranks alone)."""
    if _int(environ, "SLURM_JOB_ID", "SLURM_JOBID") is None:
        return None
    if environ.get("SLURM_HET_SIZE"):
        return HET_HINT
    nodes = _int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    if _int(environ, "SLURM_STEP_ID", "SLURM_STEPID") is None and nodes > 1:
        return (f"traceml: this SLURM job has {nodes} nodes, but this launcher runs outside a "
                f"job step and starts this node's ranks only; {RUN_HINT}")
    return None


def _node_index(environ: Mapping[str, str], hosts: list[str]) -> int:
    """This node's index among the step's hosts (``SLURMD_NODENAME`` in the list: a
    step on part of the job's nodes), else ``SLURM_NODEID``."""
    name = environ.get("SLURMD_NODENAME", "")
    if name in hosts:
        return hosts.index(name)
    return _int(environ, "SLURM_NODEID") or 0
