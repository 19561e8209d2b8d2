"""A rank's events between their take from the log and their send (agent side, the
sender thread): one outbox that builds each `wire.events.EventBatch`."""

from __future__ import annotations

from typing import Any

from traceml.wire.events import NUM_EVENT_CODES, EventBatch


class EventOutbox:
    """What the sender thread took from the probe's log since the last batch: times
    per code, device marks, RSS readings, collective spans, batch sizes, FLOP counts."""

    def __init__(self) -> None:
        self.num_batches = 0  # events messages built so far (the next one's number)
        self._empty()

    def _empty(self) -> None:
        self._times: list[list[float]] = [[] for _ in range(NUM_EVENT_CODES)]
        self._marks: list[Any] = []
        self._rss: list[tuple[float, int | None]] = []
        self._spans: list[tuple[float, float]] = []
        self._batches: list[tuple[Any, ...]] = []
        self._flop_counts: list[tuple[Any, ...]] = []
        self.num_queued = 0  # event times held

    def add(self, times: list[list[float]], marks: list[Any], rss: tuple[float, int | None],
            ) -> None:
        """Events of one take, with the RSS reading that goes with the steps they finish."""
        self._rss.append(rss)
        for out, ts in zip(self._times, times):
            out += ts
            self.num_queued += len(ts)
        self._marks += marks

    def add_records(self, spans: list[tuple[float, float]], batches: list[tuple[Any, ...]],
                    flop_counts: list[tuple[Any, ...]]) -> None:
        """The take's collective spans, batch sizes and FLOP counts."""
        self._spans += spans
        self._batches += batches
        self._flop_counts += flop_counts

    def has_events(self) -> bool:
        """Every take with events brings an RSS reading: none, nothing to send."""
        return bool(self._rss)

    def take(self, wall_offset_s: float) -> EventBatch:
        """Everything held as the next batch; the outbox starts empty again."""
        batch = EventBatch(self.num_batches, wall_offset_s, self._times, self._marks, self._rss,
                           self._spans, self._batches, self._flop_counts)
        self.num_batches += 1
        self._empty()
        return batch
