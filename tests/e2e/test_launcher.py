"""End to end: the launcher behaves like torchrun, survives a dead collector,
chains a user's sitecustomize, keeps concurrent jobs apart, rejects bad input."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import read_store, read_summary, run_traceml, script, wait_until

LOOP = script("loop.py")


def _env_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if "=" in line and not line.startswith("path:"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _rank_envs(dump_dir: Path) -> dict[str, dict[str, str]]:
    return {p.stem: _env_lines(p.read_text()) for p in sorted(dump_dir.glob("rank*.txt"))}


def test_workers_get_torchruns_environment(tmp_path: Path) -> None:
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir()
    theirs_dir.mkdir()
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("env_dump.py"),
                      env={"ENV_DUMP_DIR": str(ours_dir)})
    assert res.returncode == 0, res.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", EVIDENCE_DIR=str(res.evidence_dir),
               ENV_DUMP_DIR=str(theirs_dir))
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          script("env_dump.py")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert ref.returncode == 0, ref.stderr
    our_ranks, their_ranks = _rank_envs(ours_dir), _rank_envs(theirs_dir)
    assert sorted(our_ranks) == sorted(their_ranks) == ["rank0", "rank1"]
    for rank, ours in our_ranks.items():
        theirs = their_ranks[rank]
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS"):
            assert key in ours and key in theirs, (rank, key)
            if key != "MASTER_ADDR":
                assert ours[key] == theirs[key], (rank, key, ours[key], theirs[key])
        assert set(theirs) - set(ours) == set(), rank
        extra = {k for k in set(ours) - set(theirs)
                 if not k.startswith(("TRACEML_", "TORCHELASTIC_RUN_ID"))}
        # The only other difference: PYTHONPATH names the bootstrap directory, which
        # holds nothing but sitecustomize.py.
        if "PYTHONPATH" not in theirs:
            extra.discard("PYTHONPATH")
            site_dir = Path(ours["PYTHONPATH"])
            assert site_dir.name == "site_dir"
            assert [p.name for p in site_dir.iterdir() if p.name != "__pycache__"] == [
                "sitecustomize.py"]
        assert extra == set(), (rank, extra)
        # sitecustomize took traceml's directory back off sys.path
        path_lines = (ours_dir / f"{rank}.txt").read_text().splitlines()
        assert not [p for p in path_lines if p.startswith("path:") and "site_dir" in p]


def test_module_mode_and_console_script(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(Path(LOOP).read_text())
    res = run_traceml(tmp_path, "run", "-m", "mypkg.train", "--steps", "5",
                      traceml_cmd=["traceml"])
    assert res.returncode == 0, res.stderr
    assert len(res.steps) == 5


def test_collector_killed_mid_run(tmp_path: Path) -> None:
    evidence = tmp_path / "evidence"
    evidence.mkdir()
    env = dict(os.environ, EVIDENCE_DIR=str(evidence), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
         "--session-id", "k", script("loop.py"), "--steps", "400", "--input-sleep-ms", "2"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = tmp_path / "logs" / "k" / "telemetry.sqlite"
    assert wait_until(lambda: store.exists() and read_store(store)[0], 60), \
        "the run never stored a step"
    collector_pid = _collector_pid(proc.pid)
    assert collector_pid, "no collector process under the launcher"
    assert proc.poll() is None, "the run ended before the collector was killed"
    os.kill(collector_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "collector stopped" in err
    assert time.monotonic() - killed_at < 30
    assert (evidence / "rank0.json").exists()
    # The summary still says how the run ended, and that its telemetry stopped early.
    summary = read_summary(tmp_path / "logs" / "k")
    assert summary is not None
    assert (summary["meta"]["exit_code"], summary["meta"]["telemetry_complete"]) == (0, False)
    assert summary["meta"]["ended_at"] > summary["meta"]["started_at"]
    assert "Telemetry stopped early" in out


def _collector_pid(launcher_pid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher_pid and b"traceml.collector" in cmdline:
            return int(entry)
    return None


def test_user_sitecustomize_still_runs(tmp_path: Path) -> None:
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    res = run_traceml(tmp_path, "run", script("env_dump.py"),
                      env={"PYTHONPATH": str(site)})
    assert res.returncode == 0, res.stderr
    assert _env_lines(res.stdout).get("USER_SITECUSTOMIZE_RAN") == "yes"
    assert res.senders, "the agent must still be armed"


def test_two_jobs_on_one_host_do_not_collide(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
             script("loop.py"), "--steps", str(12 if name == "a" else 17)],
            cwd=tmp_path / name, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
    sessions = sorted((tmp_path / "logs").iterdir())
    assert len(sessions) == 2
    counts = sorted(len(read_store(s / "telemetry.sqlite")[0]) for s in sessions)
    assert counts == [12, 17]


def test_two_runs_with_one_session_id_cannot_both_run(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
         "--session-id", "same", script("loop.py"), "--steps", "5"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)]
    results = [(p.wait(timeout=180), p.communicate()[1]) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "already holds a run" in refused and len(refused.strip().splitlines()) == 1
    assert len(read_store(tmp_path / "logs" / "same" / "telemetry.sqlite")[0]) == 5


def test_worker_killed_reports_signal_status(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", script("kill_self.py"))
    assert res.returncode == 128 + signal.SIGKILL, res.stderr[-2000:]


@pytest.mark.parametrize("args,needle", [
    (["run", "missing_script.py"], "training script not found"),
    (["run", "--no-such-option", "x.py"], "unrecognized arguments"),
    (["run", "--session-id", "bad/id", "x.py"], "invalid --session-id"),
    (["run", "--nnodes", "2", "x.py"], "--session-id is required"),
    (["run", "--mode", "fancy", "x.py"], "invalid choice"),
    (["frobnicate"], "unknown command"),
    (["run"], "required"),
    (["run", "--session-id", "..", "x.py"], "invalid --session-id"),
    (["run", "--session-id", ".", "x.py"], "invalid --session-id"),
    (["run", "--nnodes", "2:1", "x.py"], "bad --nnodes"),
    (["run", "--nproc-per-node", "0", "x.py"], "bad --nproc-per-node"),
    (["run", "--nproc-per-node", "abc", "x.py"], "bad --nproc-per-node"),
    (["run", "--master-port", "99999", "x.py"], "bad --master-port"),
    (["run", "--no-python", "/missing"], "--no-python command not found"),
    (["run", "--sample-interval", "inf", "x.py"], "--sample-interval"),
    (["run", "--sample-interval", "nan", "x.py"], "--sample-interval"),
    # Integers past 64 bits (SQLite and torch take none): one line, not a traceback.
    (["run", "--summary-window-rows", "9" * 23, "x.py"], "must be from 1 to 1000000000"),
    (["run", "--nproc-per-node", "9" * 23, "x.py"], "bad --nproc-per-node"),
    (["run", "--session-id", "s", "--nnodes", "1:" + "9" * 23, "x.py"], "bad --nnodes"),
    (["report", "--summary-window-rows", "9" * 23, "."], "must be from 1 to 1000000000"),
    (["run", "--stall-timeout", "inf", "x.py"], "must be auto, 0 (off) or seconds > 0"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "traceml", *args], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_logs_dir_that_cannot_hold_a_session_is_one_line_exit_2(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    # Root ignores permission bits: a read-only mount is what refuses it.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                              str(read_only)], capture_output=True).returncode == 0
    try:
        for logs in (a_file, *([read_only] if mounted else [])):
            proc = subprocess.run(
                [sys.executable, "-m", "traceml", "run", "--logs-dir", str(logs),
                 script("env_dump.py")], capture_output=True, text=True, cwd=tmp_path,
                timeout=60)
            assert proc.returncode == 2, proc.stderr
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "give --logs-dir a folder you can write" in lines[0], \
                proc.stderr
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(read_only)], check=False)


def test_port_in_use_is_one_line_exit_2(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
             "--aggregator-port", str(port), script("env_dump.py")],
            capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "aggregator-port" in lines[0], proc.stderr


def test_traceml_options_after_the_script_are_named_when_the_script_refuses_them(
        tmp_path: Path) -> None:
    # As with torchrun, what follows the script goes to the script: argparse refuses
    # --html (exit 2), and the launcher says which options belonged before the script.
    res = run_traceml(tmp_path, "run", LOOP, "--steps", "2", "--html", "--nproc-per-node=2")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "unrecognized arguments: --html --nproc-per-node=2" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == ("traceml run: loop.py exited 2 (argparse's status for arguments it does "
                    "not take) and got --html --nproc-per-node, options of traceml run too; if "
                    "they were meant for traceml or torchrun, put them before the script: "
                    "traceml run [options] loop.py [script arguments]"), res.stderr


def _gone(process: object) -> bool:
    import psutil

    assert isinstance(process, psutil.Process)
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_launcher_killed_leaves_a_record_that_says_so(tmp_path: Path) -> None:
    """kill -9 of the launcher: as with torchrun (its workers run in their own sessions)
    the ranks are not stopped; the collector sees its launcher vanish, records when and
    exits; `traceml report` then says LAUNCHER LOST, exit unknown, telemetry incomplete,
    instead of "running", 0.0 s."""
    import psutil

    logs, session = tmp_path / "logs", tmp_path / "logs" / "lost"
    with (tmp_path / "out.txt").open("wb") as out, (tmp_path / "err.txt").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "traceml", "run", "--logs-dir", str(logs), "--session-id",
             "lost", script("loop.py"), "--steps", "3000", "--input-sleep-ms", "2"],
            env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path, stdout=out, stderr=err)
    store = session / "telemetry.sqlite"
    family: list[psutil.Process] = []
    try:
        assert wait_until(lambda: store.exists() and read_store(store)[0], 60), \
            "the run never stored a step"
        family = psutil.Process(proc.pid).children(recursive=True)

        def command(p: psutil.Process) -> str:
            with contextlib.suppress(psutil.Error):
                return " ".join(p.cmdline())
            return ""
        collector = [p for p in family if "traceml.collector" in command(p)]
        workers = [p for p in family if "loop.py" in command(p)]
        assert collector and workers, [command(p) for p in family]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_until(lambda: _gone(collector[0]), 30), "the collector outlived its launcher"
        assert not any(_gone(w) for w in workers)  # torchrun's behaviour: the ranks go on
    finally:
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    done = subprocess.run([sys.executable, "-m", "traceml", "report", str(session)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Verdict: LAUNCHER LOST [crit]" in done.stdout
    assert "exit unknown (launcher lost)" in done.stdout
    card = " ".join(done.stdout.replace("|", " ").split())
    assert "As with torchrun" in card and "the launcher vanished" in card
    summary = read_summary(session)
    assert summary is not None
    assert summary["ending"]["state"] == "launcher_lost"
    meta = summary["meta"]
    assert meta["exit_code"] is None and meta["telemetry_complete"] is False
    assert meta["ended_at"] > meta["started_at"]
