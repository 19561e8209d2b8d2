"""Views of many ranks: spreads across ranks, the worst ranks and the downsampled grid,
on hand-built 1-, 2-, 8- and 1024-rank inputs."""

from __future__ import annotations

import base64

import orjson
import pytest

from tests.live.conftest import GIB, WIDE_SLOW_MS, wide_run
from tests.rows import step_row
from traceml.report import build_report
from traceml.report.page.gauges import process_gauges
from traceml.report.page.snapshot import build_snapshot, snapshot_to_json
from traceml.report.page.spread import (
    ABOVE,
    HEAT_MAX_ROWS,
    MAX_BUCKETS,
    NOT_MEASURED,
    NUM_WORST,
    WIDE_RANKS,
    RankValue,
    build_grid,
    grid_to_json,
    spread,
)


def _values(num_ranks: int, slow: int | None, slow_ms: float = 50.0) -> list[RankValue]:
    return [RankValue(r, slow_ms if r == slow else 10.0 + (r % 3)) for r in range(num_ranks)]


@pytest.mark.parametrize("num_ranks", [1, 2, 8, 1024])
def test_a_planted_slow_rank_is_the_worst_and_first_of_the_worst_ranks(num_ranks: int) -> None:
    slow = num_ranks * 2 // 3
    s = spread(_values(num_ranks, slow))
    assert s is not None and s.num_ranks == num_ranks
    assert (s.worst_rank, s.worst_value) == (slow, 50.0)
    assert len(s.worst_ranks) == min(NUM_WORST, num_ranks)
    assert [v.value for v in s.worst_ranks] == sorted((v.value for v in s.worst_ranks),
                                                      reverse=True)
    if num_ranks >= 8:  # one slow rank does not move the median (nor, of many, the p90)
        assert s.median == 11.0
        assert s.p90 == (12.0 if num_ranks > 10 else pytest.approx(0.7 * 12.0 + 0.3 * 50.0))


def test_spread_of_one_and_two_ranks_and_of_rates() -> None:
    one = spread([RankValue(0, 7.0)])
    assert one is not None and (one.median, one.p90, one.worst_rank) == (7.0, 7.0, 0)
    two = spread([RankValue(0, 10.0), RankValue(1, 20.0)])
    assert two is not None and (two.median, two.p90, two.worst_rank) == (15.0, 19.0, 1)
    # Rates: lower is worse, the p90 is the rate 90 % of ranks beat.
    rates = spread([RankValue(r, 100.0 - r) for r in range(11)], worst="min")
    assert rates is not None and (rates.median, rates.p90, rates.worst_rank) == (95.0, 91.0, 10)
    assert spread([]) is None
    tie = spread([RankValue(3, 5.0), RankValue(1, 5.0), RankValue(2, 1.0)])
    assert tie is not None and [v.rank for v in tie.worst_ranks] == [1, 3, 2]


def _row(rank: int, step: int, input_ms: float) -> object:
    return step_row(rank, step, input_ms, 2.0, 3.0, 1.0, input_ms + 6.0, 0.0, None, None, GIB)


def test_a_two_rank_grid_keeps_every_step_and_rank() -> None:
    rows = [_row(r, s, 1.0 + r + s) for r in (0, 1) for s in range(3)]
    grid = build_grid(rows)  # type: ignore[arg-type]
    assert grid.row_ranks == ((0, 0), (1, 1)) and grid.steps == (0, 1, 2)
    assert grid.bucket_steps == 1
    assert grid.heat["input_ms"] == (1.0, 2.0, 3.0, 2.0, 3.0, 4.0)
    median, p90, top = grid.bands["input_ms"]
    assert median == (1.5, 2.5, 3.5) and top == (2.0, 3.0, 4.0)
    assert p90 == pytest.approx((1.9, 2.9, 3.9))
    assert "rss_bytes" in grid.bands and "rss_bytes" not in grid.heat  # memory: a band only


def test_buckets_average_steps_and_take_the_worst_rank_of_each_rank_bucket() -> None:
    # 8 ranks x 10 steps into 4 rank buckets x 4 step buckets of 3 steps.
    rows = [_row(r, s, 100.0 if (r, s) == (5, 4) else float(r)) for r in range(8)
            for s in range(10)]
    grid = build_grid(rows, max_rows=4, max_columns=4)  # type: ignore[arg-type]
    assert grid.row_ranks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert grid.steps == (0, 3, 6, 9) and grid.bucket_steps == 3
    heat = grid.heat["input_ms"]
    assert heat[8:12] == (5.0, (5.0 + 100.0 + 5.0) / 3, 5.0, 5.0)  # r5's mean beats r4's
    assert heat[12:] == (7.0,) * 4


def test_at_1024_ranks_the_grid_is_bounded_and_the_slow_rank_stands_out() -> None:
    run = wide_run(1024, 300, slow_rank=677)  # 2 steps a bucket
    grid = build_grid(run.steps)
    assert len(grid.row_ranks) == HEAT_MAX_ROWS and len(grid.steps) == 150 <= MAX_BUCKETS
    assert grid.row_ranks[0] == (0, 3) and grid.row_ranks[-1] == (1020, 1023)
    doc = grid_to_json(grid)
    heat = doc["heat"]["input_ms"]  # type: ignore[index, call-overload]
    cells = base64.b64decode(heat["cells"])
    cols = len(grid.steps)
    assert len(cells) == HEAT_MAX_ROWS * cols and NOT_MEASURED not in cells
    slow_row = 677 // 4
    assert set(cells[slow_row * cols:(slow_row + 1) * cols]) == {ABOVE}
    assert ABOVE not in cells[:slow_row * cols] + cells[(slow_row + 1) * cols:]
    median, _, top = grid.bands["input_ms"]
    assert all(m is not None and m < 3.0 for m in median)
    assert all(t is not None and t > WIDE_SLOW_MS for t in top)


def test_the_page_document_at_1024_ranks_is_small_and_names_the_slow_rank() -> None:
    run = wide_run(1024, 100, slow_rank=677)
    report = build_report(run, 10000)
    snap = build_snapshot(run, report, ended=True)
    assert snap.wide is not None and snap.series.ranks == ()
    doc = snapshot_to_json(snap, live=False)
    assert len(orjson.dumps(doc)) < 2_000_000
    assert doc["phases"] == [] and doc["summary"]["step_time"]["ranks"] == []  # type: ignore[index, call-overload]
    wide = doc["wide"]
    input_ms = wide["phases"]["input_ms"]  # type: ignore[index, call-overload]
    assert input_ms["worst_ranks"][0]["rank"] == 677 and input_ms["num_ranks"] == 1024
    assert [row.name for row in snap.processes] == ["ranks median", "ranks p90", "ranks worst"]
    assert [row.name for row in snap.nodes] == [f"{what} {place}" for what in ("nodes", "GPUs")
                                                for place in ("median", "p90", "worst")]


def test_up_to_the_threshold_every_rank_keeps_its_row_and_chart() -> None:
    run = wide_run(WIDE_RANKS, 20, slow_rank=3)
    snap = build_snapshot(run, build_report(run, 10000), ended=True)
    assert snap.wide is None and len(snap.series.ranks) == WIDE_RANKS
    assert len(snap.processes) == WIDE_RANKS
    assert snapshot_to_json(snap, live=False)["wide"] is None


def test_process_gauges_at_many_ranks_name_whose_they_are() -> None:
    run = wide_run(40, 10, slow_rank=None)
    rows = process_gauges(build_report(run, 10000))
    worst = {g.label: g.text for g in rows[-1].gauges}
    assert rows[-1].name == "ranks worst"
    assert worst["RSS"] == "2.0 GiB r39"  # the biggest RSS: 2 GiB + 39 MiB
    assert worst["CPU"] == "96% r6"
