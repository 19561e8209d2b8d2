"""Protocol envelopes, the launcher's control records and the environment contract round-trip."""

from __future__ import annotations

import typing

import pytest

from tests.raw_wire import empty_times, envelope_bytes
from traceml import stacks
from traceml.environment import AgentEnv, TorchRank, distributed_launch, without_traceml
from traceml.errors import ProtocolError
from traceml.wire.captures import CaptureReport, OperatorRow
from traceml.wire.envelope import DECODERS, Envelope, Message, PayloadError, decode, encode
from traceml.wire.events import EventBatch
from traceml.wire.identity import Sender
from traceml.wire.incidents import STALL, IncidentReport
from traceml.wire.records import (
    Bye,
    Control,
    Hello,
    RunEnd,
    RunStart,
    StopCollector,
    control_from_payload,
)
from traceml.wire.relay import RelayBatch
from traceml.wire.rows import ProcessRows, SystemRows

SENDER = Sender("rank", "h", 12, 1, rank=3, local_rank=1, world_size=4, restart=2)


def _env(message: Message | None = None, **kw: object) -> Envelope:
    base = dict(session_id="s", sender=SENDER, seq=7, sent_at=1.5,
                message=message or ProcessRows(("t", "b"), [[1, 2.5]]), num_sent=7,
                num_dropped=1)
    base.update(kw)
    return Envelope(**base)  # type: ignore[arg-type]


def test_envelope_round_trip() -> None:
    env = _env()
    back = decode(encode(env))
    assert back.sender == env.sender
    assert (back.seq, back.kind, back.num_sent, back.num_dropped) == (7, "process", 7, 1)
    assert back.message == ProcessRows(("t", "b"), [[1, 2.5]])
    assert back.sender.sender_id == "r3@n1:h:12:2"


@pytest.mark.parametrize("data,reason", [
    (b"\x00\xffgarbage", "not JSON"),
    (b"[1,2]", "not an envelope"),
    (b'{"v": 99}', "protocol version"),
    (b'{"v": 1}', "protocol version"),  # a traceml from before the phase table
    (b'{"v": 2, "kind": "events"}', "protocol version"),  # a traceml from before the hook
    (b'{"v": 3, "kind": "events"}', "protocol version"),  # ...from before typed messages
    (b'{"v": 4, "kind": "steps"}', "malformed"),  # that kind is gone
])
def test_decode_rejects(data: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(data)


def test_decode_rejects_oversized() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b" " * 100, max_bytes=50)


def test_unknown_kind_and_bad_rows() -> None:
    with pytest.raises(ProtocolError, match="unknown kind"):
        decode(envelope_bytes("s", "nope", SENDER, 0, {}))
    with pytest.raises(PayloadError, match="row does not match fields"):
        decode(envelope_bytes("s", "process", SENDER, 0, {"fields": ["t"], "rows": [[1, 2]]}))
    # samples without their time: the store could not keep them (found by the fuzzer)
    for kind in ("process", "system"):
        with pytest.raises(PayloadError, match="rows without their time 't'"):
            decode(envelope_bytes("s", kind, SENDER, 0, {"fields": ["cpu_pct"], "rows": [[5.0]]}))


def _samples() -> list[Message]:
    """One message of every kind, as its senders build them."""
    times = empty_times()
    times[0] = [1.0]
    report = IncidentReport(STALL, 1.7e9, 1.7e9 + 5, (stacks.Frame("a.py", 3, "f"),),
                            "python", detail={"why": "x"})
    return [EventBatch(0, 1.7e9, times, rss=[[1.0, 4096]]),
            ProcessRows(("t", "cpu_pct"), [[1.7e9, 5.0]]),
            SystemRows(("t", "gpus"), [[1.7e9, [[0, 5.0, 1, 2, 40.0, 100.0]]]]),
            Hello(1.7e9), Bye(1.7e9, 3), START, RunEnd(1.7e9, 0), StopCollector(), report,
            RelayBatch([(SENDER, [1.7e9, 1.7e9, 1, 0, 0, 1, 0, False])], [], [], [], [], [],
                       [(1, 1.7e9)], {"x": 1}),
            CaptureReport("c1", 2, 2, 1.7e9, 1.7e9 + 1, "/l/c1-r0.pt.trace.json.gz", 10, None,
                          None, (OperatorRow("aten::mm", "[2, 2]", 3.0, 1.5, None),))]


def test_decode_returns_one_of_a_closed_union_every_kind_round_trips() -> None:
    samples = _samples()
    assert {type(m) for m in samples} == set(typing.get_args(Message))
    assert {m.KIND for m in samples} == set(DECODERS)
    for message in samples:
        assert decode(encode(_env(message))).message == message


def test_environment_contract_round_trip() -> None:
    env = AgentEnv(session_id="x.y-1", endpoint="tcp://127.0.0.1:5", launcher_pid=42,
                   mode="watch", node_rank=3, sample_interval_s=0.25, flush_interval_s=0.1,
                   arm_dir="/tmp/a", session_dir="/tmp/logs/x.y-1", client_keys="k",
                   key_socket="/tmp/k.sock", rank_token="t")
    variables = env.to_env()
    assert all(k.startswith("TRACEML_") for k in variables)
    assert AgentEnv.from_env(variables) == env
    assert AgentEnv.from_env({}) is None
    assert without_traceml({**variables, "PATH": "/bin"}) == {"PATH": "/bin"}


def test_torch_rank_variables_are_read_in_one_place() -> None:
    worker = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2",
              "TORCHELASTIC_RESTART_COUNT": "3"}
    assert TorchRank.from_env(worker) == TorchRank(5, 1, 8, 2, 3)
    assert TorchRank.from_env({"RANK": "0", "GROUP_RANK": ""}) == TorchRank(0)
    assert TorchRank.from_env({"WORLD_SIZE": "8"}) is None  # no RANK: not torch's worker
    assert TorchRank.from_env({"RANK": ""}) is None
    assert distributed_launch(worker) and not distributed_launch({"WORLD_SIZE": ""})
    from pathlib import Path

    import traceml

    readers = [p.name for p in Path(traceml.__file__).parent.rglob("*.py")
               if '"LOCAL_RANK"' in p.read_text() or '"TORCHELASTIC_RESTART_COUNT"' in p.read_text()]
    assert readers == ["environment.py"]


def test_only_environment_module_touches_traceml_variables() -> None:
    from pathlib import Path

    import traceml

    root = Path(traceml.__file__).parent
    offenders = [p for p in root.rglob("*.py")
                 if "TRACEML_" in p.read_text() and p.name != "environment.py"]
    assert offenders == []


START = RunStart(
    session_id="s1", command=("traceml", "run", "train.py"), started_at=1.5e9,
    traceml_version="9.9", torch_version="2.x", python_version="3.11.1",
    summary_window_rows=50, mode="run", expected_world_size=2, expected_nodes=1)


@pytest.mark.parametrize("record", [START, RunEnd(ended_at=1.5e9 + 30, exit_code=3),
                                    StopCollector()])
def test_control_records_round_trip(record: Control) -> None:
    assert decode(encode(_env(record))).message == record
    assert control_from_payload(record.payload()) == record


@pytest.mark.parametrize("payload,reason", [
    ({"op": "meta", "values": {}}, "unknown control op"),
    ({"op": "run_end", "ended_at": 1.5e9}, "RunEnd without exit_code"),
    ({"op": "run_end", "ended_at": 1.5e9, "exit_code": "0"}, "exit_code: str is not a int"),
    ({**START.payload(), "command": "train.py"}, "command"),
])
def test_malformed_control_payloads_are_rejected(payload: dict[str, object], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        control_from_payload(payload)


def test_intake_reasons_are_fixed_and_foreign_sessions_cost_no_parse() -> None:
    from traceml.collector.intake import Rejected, accept, session_prefix

    prefix = session_prefix("s")
    sender = Sender("rank", "h", 1, 0, rank=0, world_size=1)
    good = encode(Envelope("s", sender, 0, 1.0, Hello(1.0)))
    assert accept(good, prefix, 1 << 20).sender == sender
    cases = {b"x" * 2000: "oversized message",
             good.replace(b'"sid":"s"', b'"sid":"t"') + b" " * 500: "foreign session",
             b"[1,2]": "not an envelope of this protocol",
             good.replace(b'"t":1.0', b'"t":-5'): "bad hello payload",
             good.replace(b'"seq":0', b'"seq":-1'): "malformed envelope"}
    for data, reason in cases.items():
        with pytest.raises(Rejected) as exc:
            accept(data, prefix, 1000)
        assert exc.value.reason == reason
