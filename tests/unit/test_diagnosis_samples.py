"""RunData <-> JSON round trip (the format of the recorded scenarios)."""

from __future__ import annotations

import json

import pytest

from tests.rows import step_row
from traceml.records import GpuSample, NodeInfo, ProcessSample, RunData, RunMeta, SystemSample
from traceml.records_json import from_jsonable, to_jsonable


def sample_run() -> RunData:
    meta = RunMeta(
        session_id="s1", command=["train.py", "--lr", "0.1"], started_at=100.0, ended_at=160.5,
        exit_code=None, partial=True, world_size=2, missing_ranks=(1,),
        nodes=(NodeInfo(0, "h0", (0, 1)),), device="cuda",
        versions={"traceml": "0.1.0", "torch": "2.5.1", "python": "3.11.7"},
        transport={"sent": 10, "dropped": 1, "gaps": 0, "rejected": 0}, mode="run",
    )
    steps = (step_row(0, 0, 1.5, 2.0, 3.0, 4.0, 11.0, 0.5, 10, 20, 30, None, 101.0),
             step_row(0, 1, 1.0, 2.0, 3.0, 4.0, 10.0, 0.0))
    process = (ProcessSample(0, 0, 101.0, 99.5, 1000, 8000, 8, None, None, None),)
    gpus = (GpuSample(0, 50.0, 1, 2, 60.0, None), GpuSample(1, None, None, None, None, None))
    system = (SystemSample(0, "h0", 101.0, 10.0, 20.0, 8000, gpus),
              SystemSample(0, "h0", 102.0, 11.0, 21.0, 8000))
    return RunData(meta, steps, process, system)


def test_round_trip_through_json_text() -> None:
    run = sample_run()
    text = json.dumps(to_jsonable(run))
    assert from_jsonable(json.loads(text)) == run


def test_rows_are_stored_column_wise() -> None:
    steps = to_jsonable(sample_run())["steps"]
    assert isinstance(steps, dict)
    fields = steps["fields"]
    assert isinstance(fields, list) and {"rank", "step", "input_ms"} <= set(fields)
    row = dict(zip(fields, steps["rows"][1]))  # type: ignore[index]
    assert (row["rank"], row["step"], row["input_ms"]) == (0, 1, 1.0)


def test_older_rows_without_new_optional_fields_still_load() -> None:
    doc = to_jsonable(sample_run())
    steps = doc["steps"]
    assert isinstance(steps, dict)
    # The fields of the first format, before any optional field or later phase.
    old = ["rank", "step", "input_ms", "forward_ms", "backward_ms", "optimizer_ms", "total_ms",
           "wait_ms"]
    keep = [steps["fields"].index(f) for f in old]  # type: ignore[union-attr]
    steps["fields"] = old
    steps["rows"] = [[r[i] for i in keep] for r in steps["rows"]]  # type: ignore[union-attr,index]
    assert from_jsonable(doc).steps[0].peak_allocated_bytes is None


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: d.update(format="other/9"), ValueError),
        (lambda d: d["steps"]["fields"].append("bogus"), ValueError),
        (lambda d: d["steps"]["rows"][0].pop(), ValueError),
        (lambda d: d.update(process="nope"), TypeError),
        (lambda d: d["meta"]["nodes"][0].update(ranks="0"), TypeError),
    ],
)
def test_malformed_run_data_is_rejected(mutate: object, error: type[Exception]) -> None:
    doc = json.loads(json.dumps(to_jsonable(sample_run())))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(error):
        from_jsonable(doc)
