"""What a key holder cannot do at the collector's dispatch (traceml.collector.dispatch,
on a real SQLite store): speak for an identity without its token, send more bytes than
a sender's budget, or more rows or events than any sender sends in one message."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.raw_wire import empty_times, envelope_bytes
from traceml.collector import dispatch
from traceml.collector.config import CollectorConfig
from traceml.collector.dispatch import ByteBudgets, Collector
from traceml.security import TokenBook
from traceml.store import StoreWriter
from traceml.wire import events as ev
from traceml.wire.envelope import Envelope, Message, encode
from traceml.wire.identity import Sender
from traceml.wire.records import Hello
from traceml.wire.rows import MAX_ROWS, PROCESS_FIELDS, ProcessRows

BOOK = TokenBook("s3cret", "s")
RANK1 = Sender("rank", "h", 11, 0, rank=1, local_rank=1, world_size=2)


def collector(tmp_path: Path) -> Collector:
    config = CollectorConfig("s", "127.0.0.1", 0, "", 0, secret="s3cret", tokens=True)
    return Collector(config, StoreWriter(str(tmp_path / "t.sqlite")))


def send(c: Collector, who: Sender, seq: int, message: Message, token: str | None) -> None:
    c.handle(encode(Envelope("s", who, seq, 1.7e9, message, token=token)))


def test_a_rank_token_speaks_for_its_rank_and_attempt_only(tmp_path: Path) -> None:
    c = collector(tmp_path)
    send(c, RANK1, 0, Hello(1.7e9), BOOK.rank(1))
    assert c.rejected == {} and RANK1.sender_id in c.senders
    for who, token in ((Sender("rank", "h", 12, 0, rank=0, local_rank=0, world_size=2),
                        BOOK.rank(1)),  # another rank
                       (Sender("rank", "h", 13, 0, rank=1, world_size=2, restart=1),
                        BOOK.rank(1)),  # another attempt of the rank
                       (Sender("system", "h", 14, 0), BOOK.rank(1)),  # a node's sampler
                       (Sender("rank", "h", 15, 0, rank=0, world_size=2), None)):
        send(c, who, 0, Hello(1.7e9), token)
    assert c.rejected == {"sender without the token of its identity": 4}
    assert set(c.senders) == {RANK1.sender_id}


def test_a_sender_over_its_byte_rate_is_cut_and_counted(tmp_path: Path) -> None:
    clock = [0.0]
    c = collector(tmp_path)
    c._budgets = ByteBudgets(lambda: clock[0])
    rows = ProcessRows(PROCESS_FIELDS, [[1.7e9, 1.0, 1, 1, 1, None, None, None]] * MAX_ROWS)
    size = len(encode(Envelope("s", RANK1, 0, 1.7e9, rows, token=BOOK.rank(1))))
    burst = dispatch.SENDER_BURST_BYTES // size
    for seq in range(burst + 3):
        send(c, RANK1, seq, rows, BOOK.rank(1))
    assert c.rejected == {"over its sender's byte rate": 3}
    clock[0] += 2 * size / dispatch.SENDER_BYTES_PER_S  # the budget fills again, slowly
    send(c, RANK1, burst + 3, rows, BOOK.rank(1))
    assert c.rejected == {"over its sender's byte rate": 3}
    assert c.senders[RANK1.sender_id].num_messages == burst + 1


@pytest.mark.parametrize(("kind", "payload"), [
    ("process", {"fields": ["t"], "rows": [[1.7e9]] * (MAX_ROWS + 1)}),
    ("events", {"batch": 0, "wall_offset": 0.0, "marks": [], "rss": [],
                "times": [[1.0] * (ev.MAX_EVENTS_ACCEPTED + 1)] + empty_times()[1:]}),
])
def test_more_than_any_sender_sends_in_a_message_is_refused(tmp_path: Path, kind: str,
                                                            payload: dict[str, object]) -> None:
    c = collector(tmp_path)
    c.handle(envelope_bytes("s", kind, RANK1, 0, payload, token=BOOK.rank(1)))
    assert c.rejected == {f"bad {kind} payload": 1}


def test_made_up_tokens_are_refused_before_decoding_and_cost_no_budget(tmp_path: Path) -> None:
    c = collector(tmp_path)
    rows = ProcessRows(PROCESS_FIELDS, [[1.7e9, 1.0, 1, 1, 1, None, None, None]] * MAX_ROWS)
    for seq in range(50):  # a fresh token each time, then one of a megabyte
        send(c, RANK1, seq, rows, f"made-up-{seq}")
    send(c, RANK1, 50, rows, "x" * (1 << 20))
    send(c, RANK1, 51, rows, "é" * 43)  # not ASCII: compare_digest would raise on it
    assert c.rejected == {"sender without the token of its identity": 52}
    assert c._budgets._left == {}  # nothing kept per token it was never given
    send(c, RANK1, 52, Hello(1.7e9), BOOK.rank(1))  # the rank's own token still speaks
    assert RANK1.sender_id in c.senders


def test_without_tokens_each_claimed_identity_has_its_budget(tmp_path: Path) -> None:
    """Ray's workers carry no token: a flood is cut per identity it claims."""
    clock = [0.0]
    config = CollectorConfig("s", "127.0.0.1", 0, "", 0, secret="s3cret", tokens=False)
    c = Collector(config, StoreWriter(str(tmp_path / "t.sqlite")))
    c._budgets = ByteBudgets(lambda: clock[0])
    rows = ProcessRows(PROCESS_FIELDS, [[1.7e9, 1.0, 1, 1, 1, None, None, None]] * MAX_ROWS)
    size = len(encode(Envelope("s", RANK1, 0, 1.7e9, rows)))
    burst = dispatch.SENDER_BURST_BYTES // size
    for seq in range(burst + 2):
        send(c, RANK1, seq, rows, None)
    assert c.rejected == {"over its sender's byte rate": 2}
    rank0 = Sender("rank", "h", 12, 0, rank=0, local_rank=0, world_size=2)
    send(c, rank0, 0, rows, None)  # another identity: its own budget
    assert c.rejected == {"over its sender's byte rate": 2} and rank0.sender_id in c.senders


def test_samples_without_their_time_are_refused_and_the_store_stays_sound(tmp_path: Path) -> None:
    """Found by scripts/fuzz_collector.py: rows whose fields leave out ``t`` passed the
    checks, then failed SQLite's NOT NULL, and marked the store as failed."""
    c = collector(tmp_path)
    c.handle(envelope_bytes("s", "process", RANK1, 0, {"fields": ["cpu_pct"], "rows": [[5.0]]},
                            token=BOOK.rank(1)))
    assert c.rejected == {"bad process payload": 1} and not c.store_failed
