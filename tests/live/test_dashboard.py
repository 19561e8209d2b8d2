"""The dashboard's HTTP server (collector side), without a browser."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.live.conftest import GIB, T0
from tests.rows import run_start, sent_by, step_record
from traceml.collector.config import CollectorConfig
from traceml.launcher.collector_process import CollectorProcess
from traceml.live.dashboard import Dashboard
from traceml.store import SenderState, StoreWriter
from traceml.wire.identity import Sender


def get(url: str, host: str | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def make_store(path: Path, num_steps: int = 12) -> None:
    writer = StoreWriter(str(path))
    writer.save_run(run_start("dash", T0, summary_window_rows=100, expected_world_size=2))
    for rank in (0, 1):
        sender = Sender(role="agent", host="h", pid=10 + rank, node_rank=0, rank=rank,
                        local_rank=rank, world_size=2)
        writer.save_sender(SenderState(sender, T0, T0))
        values = {"t_begin": T0, "input_ms": 1.0 + rank, "forward_ms": 2.0, "backward_ms": 3.0,
                  "optimizer_ms": 1.0, "total_ms": 10.0, "wait_ms": 3.0 - rank, "rss_bytes": GIB}
        writer.add_steps(sent_by(sender, [step_record(s, **values) for s in range(num_steps)]))
    writer.close()


@pytest.fixture()
def dashboard(tmp_path: Path) -> Any:
    make_store(tmp_path / "telemetry.sqlite")
    board = Dashboard(tmp_path / "telemetry.sqlite", "dash")
    yield board
    board.close()


def test_serves_the_page_and_snapshots_on_loopback(dashboard: Dashboard) -> None:
    port = free_port()
    address = dashboard.start("127.0.0.1", port)
    root = f"http://127.0.0.1:{port}/{dashboard.token}/"
    assert address == {"url": root, "port": port, "requested_port": port}
    assert len(dashboard.token) >= 32
    status, kind, body = get(root)
    assert (status, kind) == (200, "text/html; charset=utf-8")
    assert b'{"poll":"api/snapshot","interval_ms":1000}' in body
    status, kind, body = get(root + "api/snapshot")
    doc = json.loads(body)
    assert (status, kind, doc["live"], doc["ended"]) == (200, "application/json", True, False)
    assert [r["rank"] for r in doc["series"]["ranks"]] == [0, 1]
    assert doc["summary"]["meta"]["session_id"] == "dash"
    assert get(root + "etc/passwd")[0] == 404


def test_a_request_without_the_token_or_from_a_foreign_host_is_refused(
        dashboard: Dashboard) -> None:
    """Another local user can reach the port but not read the terminal the address was
    printed on; a web page that rebinds its name to 127.0.0.1 sends its own Host."""
    port = free_port()
    root = str(dashboard.start("127.0.0.1", port)["url"])
    wrong = root.replace(dashboard.token, "x" * len(dashboard.token))
    for url in (f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}/api/snapshot",
                wrong, wrong + "api/snapshot", root[:-1] + "api/snapshot"):
        status, _, body = get(url)
        assert (status, body) == (403, b"forbidden: open the address traceml printed: it "
                                       b"carries this run's token\n"), url
    for host in ("evil.example", f"evil.example:{port}", f"10.0.0.1:{port}"):
        status, _, body = get(root + "api/snapshot", host=host)
        assert status == 403 and b"answers only to 127.0.0.1, localhost or [::1]" in body, host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert get(root + "api/snapshot", host=host)[0] == 200, host


def test_bound_to_every_address_the_token_still_guards(tmp_path: Path) -> None:
    make_store(tmp_path / "telemetry.sqlite")
    board = Dashboard(tmp_path / "telemetry.sqlite", "dash")
    try:
        port = free_port()
        root = str(board.start("0.0.0.0", port)["url"])
        assert get(root + "api/snapshot", host=f"node0.cluster:{port}")[0] == 200
        assert get(f"http://127.0.0.1:{port}/api/snapshot", host=f"node0.cluster:{port}")[0] == 403
    finally:
        board.close()


def test_a_taken_port_moves_to_a_free_one(dashboard: Dashboard) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        address = dashboard.start("127.0.0.1", port)
    assert address["requested_port"] == port and address["port"] != port
    assert get(str(address["url"]))[0] == 200


def test_finish_hands_the_final_report_to_an_open_page(dashboard: Dashboard) -> None:
    url = str(dashboard.start("127.0.0.1", free_port())["url"]) + "api/snapshot"
    assert json.loads(get(url)[2])["ended"] is False  # a page is open and polling
    finals: list[dict[str, Any]] = []

    def page() -> None:  # polls like the page until it sees the end
        while not finals:
            doc = json.loads(get(url)[2])
            if doc["ended"]:
                finals.append(doc)

    poller = threading.Thread(target=page)
    poller.start()
    dashboard.finish()
    poller.join(10)
    assert finals and finals[0]["summary"]["step_time"]["scope"]["num_steps"] > 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_the_collector_runs_the_dashboard_when_asked(tmp_path: Path) -> None:
    port = free_port()
    collector = CollectorProcess(CollectorConfig(
        session_id="c", bind_host="127.0.0.1", port=0, db_path=str(tmp_path / "t.sqlite"),
        parent_pid=os.getpid(), dashboard_port=port))
    try:
        url = collector.ready["dashboard"]["url"]
        assert re.fullmatch(rf"http://127\.0\.0\.1:{port}/[A-Za-z0-9_-]{{32}}/", url), url
        assert get(url + "api/snapshot")[0] == 200
    finally:
        assert collector.stop() == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
