"""Inside ``srun``: SLURM's node list expanded as ``scontrol show hostnames`` does, and
the options SLURM's environment fills (the user's own win)."""

from __future__ import annotations

import pytest

from tests import schedulers
from traceml.errors import UsageError
from traceml.launcher.args import parse
from traceml.launcher.slurm import expand_nodelist


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("tux1", ["tux1"]),
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("tux[1,3-5]", ["tux1", "tux3", "tux4", "tux5"]),
    ("gpu-a[1,3-5],gpu-b7", ["gpu-a1", "gpu-a3", "gpu-a4", "gpu-a5", "gpu-b7"]),
    ("node[008-011]", ["node008", "node009", "node010", "node011"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("rack[1-2]-n[01,03]", ["rack1-n01", "rack1-n03", "rack2-n01", "rack2-n03"]),
    ("a[1-2],b,c[05]", ["a1", "a2", "b", "c05"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_nodelist_forms(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "why"), [
    ("node[1-", "unbalanced '\\['"), ("node1]", "unbalanced '\\]'"),
    ("node[4-2]", "runs backwards"), ("node[a-b]", "not a number or a range"), (",", "empty"),
])
def test_a_nodelist_that_cannot_be_read_says_so(nodelist: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        expand_nodelist(nodelist)


def srun_env(node_id: int, **extra: str) -> dict[str, str]:
    return schedulers.srun_env(node_id, ["gpu-a1", "gpu-a3"], "gpu-a[1,3]", **extra)


def test_srun_fills_what_torchrun_needs() -> None:
    cfg = parse("run", ["train.py"], srun_env(1))
    assert (cfg.min_nodes, cfg.max_nodes, cfg.node_rank) == (2, 2, 1)
    assert cfg.torch.master_addr == "gpu-a1" and cfg.torch.master_port == 10000 + 4 * 4242
    assert cfg.scheduler_hint == "" and "--nnodes=2" in cfg.filled_options
    assert cfg.aggregator_port == cfg.torch.master_port + 2
    assert cfg.torch.nproc_per_node == "1"
    assert cfg.session_id == "slurm-4242" and cfg.session_id_given
    assert cfg.training_script == "train.py"


def test_gpus_on_the_node_are_its_ranks() -> None:
    cfg = parse("run", ["train.py"], srun_env(0, SLURM_GPUS_ON_NODE="8"))
    assert cfg.torch.nproc_per_node == "8" and cfg.node_rank == 0


def test_explicit_options_win() -> None:
    cfg = parse("run", ["--nproc-per-node=2", "--session-id=mine", "--master-port=29500",
                        "--node-rank=0", "train.py"], srun_env(1))
    assert cfg.torch.nproc_per_node == "2" and cfg.session_id == "mine"
    assert cfg.torch.master_port == 29500 and cfg.node_rank == 0
    assert cfg.max_nodes == 2  # what was not given still comes from SLURM


def test_later_steps_get_their_own_session_and_the_node_rank_follows_the_step() -> None:
    # A second step on the job's second node only: that node is the step's node 0
    # (SLURM_NODEID is relative to the step), and on one node the launcher picks its ports.
    env = srun_env(1, SLURM_STEP_ID="3", SLURM_STEPID="3", SLURM_STEP_NUM_NODES="1",
                   SLURM_STEP_NODELIST="gpu-a3", SLURM_STEP_TASKS_PER_NODE="1",
                   SLURM_NODEID="0")
    cfg = parse("run", ["train.py"], env)
    assert cfg.session_id == "slurm-4242.3"
    assert (cfg.max_nodes, cfg.node_rank) == (1, 0)
    assert not any(o.startswith(("--master-", "--aggregator-")) for o in cfg.filled_options)
    assert cfg.aggregator_port is None and cfg.torch.master_port != 10000 + 4 * 4242


def test_two_steps_of_one_job_on_the_same_nodes_get_their_own_ports() -> None:
    first = parse("run", ["train.py"], srun_env(0))
    second = parse("run", ["train.py"], srun_env(0, SLURM_STEP_ID="1", SLURM_STEPID="1"))
    assert first.torch.master_port != second.torch.master_port
    assert abs(first.torch.master_port - second.torch.master_port) >= 4  # 4 ports each
    assert (first.session_id, second.session_id) == ("slurm-4242", "slurm-4242.1")


def test_a_requeued_job_gets_a_session_of_its_own() -> None:
    cfg = parse("run", ["train.py"], srun_env(0, SLURM_RESTART_COUNT="2"))
    assert cfg.session_id == "slurm-4242.r2"
    assert parse("run", ["train.py"], srun_env(0, SLURM_RESTART_COUNT="0")).session_id == \
        "slurm-4242"


def test_a_heterogeneous_job_fills_nothing_and_says_what_to_give() -> None:
    cfg = parse("run", ["train.py"], srun_env(0, SLURM_HET_SIZE="2"))
    assert cfg.filled_options == () and cfg.max_nodes == 1
    assert "heterogeneous SLURM job" in cfg.scheduler_hint and "--node-rank" in cfg.scheduler_hint
    given = parse("run", ["--nnodes=2", "--node-rank=1", "--master-addr=gpu-a1",
                          "--session-id=het", "train.py"], srun_env(1, SLURM_HET_SIZE="2"))
    assert given.scheduler_hint == "" and given.node_rank == 1


def test_outside_a_step_nothing_is_filled() -> None:
    env = {k: v for k, v in srun_env(0).items() if not k.startswith(("SLURM_STEP", "SLURM_PROCID"))}
    cfg = parse("run", ["train.py"], env)
    assert cfg.max_nodes == 1 and cfg.filled_options == ()
    # the batch script of a 2-node job: this launcher would run one node alone
    assert "has 2 nodes" in cfg.scheduler_hint and "srun --ntasks-per-node=1" in cfg.scheduler_hint
    alone = {**env, "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1"}
    assert parse("run", ["train.py"], alone).scheduler_hint == ""
    assert parse("run", ["train.py"], {}).filled_options == ()
    assert parse("run", ["train.py"], {}).scheduler_hint == ""


def test_several_launchers_on_a_node_are_refused_in_one_line() -> None:
    env = srun_env(0, SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_NTASKS_PER_NODE="8")
    with pytest.raises(UsageError, match="starts 8 tasks on this node.*srun --ntasks-per-node=1"):
        parse("run", ["train.py"], env)


def test_a_bad_slurm_number_is_one_line() -> None:
    with pytest.raises(UsageError, match="SLURM_NNODES='two' is not a number"):
        parse("run", ["train.py"], {**srun_env(0), "SLURM_STEP_NUM_NODES": "",
                                    "SLURM_NNODES": "two"})
