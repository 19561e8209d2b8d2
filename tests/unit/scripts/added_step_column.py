"""A step column added to the step-field table and nothing else, run through the
collector's whole path.

``python added_step_column.py OUT``: appends a reported ``dummy_ms`` column to
`traceml.step_fields.STEP_FIELDS` before anything else is imported, and stands in
for the code that would measure it (each tracked step gets a tenth of its total,
where `traceml.collector.rank_steps.step_row` builds the row).  Two ranks' events
then go as real wire messages through a node's relay (its collector and outbox),
the relay's batch through node 0's intake into a real SQLite store, and the
session is summarised; OUT gets the session folder, the recorded-scenario JSON
(`traceml.records_json.to_jsonable`) of what the store read back, and the summary
schema's problems.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from traceml import step_fields

step_fields.STEP_FIELDS = (*step_fields.STEP_FIELDS,
                           step_fields.StepField("dummy_ms", float, 0.0, reported=True,
                                                 high=step_fields.MAX_STEP_MS))

from traceml.collector import rank_steps  # noqa: E402
from traceml.collector.config import CollectorConfig  # noqa: E402
from traceml.collector.dispatch import Collector  # noqa: E402
from traceml.collector.relay import Outbox  # noqa: E402
from traceml.records_json import to_jsonable  # noqa: E402
from traceml.report.schema import validate_summary  # noqa: E402
from traceml.report.session import load_run, write_summary  # noqa: E402
from traceml.store import StoreWriter  # noqa: E402
from traceml.wire import events as ev  # noqa: E402
from traceml.wire.envelope import Envelope, Message, encode  # noqa: E402
from traceml.wire.identity import Sender  # noqa: E402
from traceml.wire.records import Bye, RunEnd, RunStart  # noqa: E402

SESSION = "dummy"
T0 = 1_767_225_600.0
NUM_STEPS = 30
measured = rank_steps.step_row


def with_dummy(*args: object) -> object:
    """The stand-in measurement: a tenth of the step's total."""
    row = measured(*args)  # type: ignore[arg-type]
    return row.replace(dummy_ms=row.total_ms / 10)


rank_steps.step_row = with_dummy  # type: ignore[assignment]


class Upstream:
    """The relay's upstream: node 0's collector itself, handed each batch's bytes."""

    def __init__(self, node0: Collector) -> None:
        self.identity = Sender("relay", "box", 9, 1)
        self.node0, self.seq = node0, 0

    def send(self, message: Message) -> bool:
        env = Envelope(SESSION, self.identity, self.seq, T0, message)
        self.seq += 1
        self.node0.handle(encode(env), from_relay=True)
        return True


def events(rank: int) -> ev.EventBatch:
    """NUM_STEPS iterations of rank ``rank`` (r1's backward 4 ms longer)."""
    times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
    step_s = 0.010 + 0.004 * rank
    for step in range(NUM_STEPS):
        at = step * step_s
        for code, dt in ((ev.INPUT, 0.0), (ev.END, 0.001), (ev.FORWARD, 0.001),
                         (ev.END, 0.003), (ev.BACKWARD, 0.003),
                         (ev.END, 0.008 + 0.004 * rank), (ev.OPTIMIZER, 0.008 + 0.004 * rank),
                         (ev.OPTIMIZER_END, 0.009 + 0.004 * rank)):
            times[code].append(at + dt)
    times[ev.CLOSE].append(NUM_STEPS * step_s)
    return ev.EventBatch(0, T0, times, [], [(0.0, 1 << 30)])


def main() -> None:
    folder = Path(sys.argv[1]) / SESSION
    folder.mkdir(parents=True)
    node0 = Collector(CollectorConfig(SESSION, "127.0.0.1", 0, "", 0),
                      StoreWriter(str(folder / "telemetry.sqlite")))
    node0.store.save_run(RunStart(
        session_id=SESSION, command=(), started_at=T0, traceml_version="", torch_version="",
        python_version="", summary_window_rows=10000, mode="run", expected_world_size=2))
    outbox = Outbox(Upstream(node0))  # type: ignore[arg-type]
    relay = Collector(CollectorConfig(SESSION, "127.0.0.1", 0, "", 0, node_rank=1), outbox)
    for rank in (0, 1):
        who = Sender("rank", "box", 100 + rank, 1, rank, rank, 2)
        for seq, message in enumerate((events(rank), Bye(T0 + 1))):
            relay.handle(encode(Envelope(SESSION, who, seq, T0, message)))
    outbox.commit()
    node0.store.save_run(RunEnd(ended_at=T0 + 1.0, exit_code=0))
    node0.close()
    files = write_summary(folder)
    (folder.parent / "schema_problems.txt").write_text("\n".join(validate_summary(files.summary)))
    run, _ = load_run(folder, None, None, full=True)
    (folder.parent / "run.json").write_text(json.dumps(to_jsonable(run)))
    (folder.parent / "rejected.json").write_text(json.dumps(node0.all_rejected()))


if __name__ == "__main__":
    main()
