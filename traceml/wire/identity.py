"""Who sends a message (`Sender`) and the bounds of a job's numbers (wire: shared by
every process that sends or receives)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from traceml import step_fields

ROLES = frozenset({"rank", "system", "launcher", "watch", "relay"})

# Bounds of a sender's identity: beyond them the numbers are not a job's.
MAX_WORLD_SIZE = step_fields.MAX_RANKS
MAX_NODES = 1 << 14
MAX_RESTARTS = 1 << 20
MAX_HOST_CHARS = 255
MAX_INT = 2**63 - 1


@dataclass(frozen=True)
class Sender:
    """Who sent a message.  ``rank`` is None for node-level senders."""

    role: str  # "rank" | "system" | "launcher" | "watch" | "relay"
    host: str
    pid: int
    node_rank: int
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    restart: int = 0

    @functools.cached_property
    def sender_id(self) -> str:
        who = f"r{self.rank}" if self.rank is not None else self.role
        return f"{who}@n{self.node_rank}:{self.host}:{self.pid}:{self.restart}"

    def values(self) -> list[Any]:
        """The identity as the wire carries it (``from`` of an envelope)."""
        return [self.role, self.host, self.pid, self.node_rank, self.rank, self.local_rank,
                self.world_size, self.restart]


NUM_SENDER_VALUES = 8


def sender_from(values: Any) -> Sender:
    """A sender identity, checked: exact types, and numbers a job can have; TypeError
    or ValueError otherwise.  The identities already checked are remembered by their
    values and types (node 0 reads the same ones thousands of times a second)."""
    if type(values) is not list or len(values) != NUM_SENDER_VALUES:
        raise TypeError("sender identity is not a list of 8")
    try:
        return _checked_sender((*values, *map(type, values)))
    except TypeError as exc:  # unhashable: not an identity
        raise TypeError(f"sender identity of unhashable values: {exc}") from None


@functools.lru_cache(maxsize=1 << 15)
def _checked_sender(key: tuple[Any, ...]) -> Sender:
    """``key``: the identity's values, then their types (True is 1 to a cache)."""
    role, host, pid, node_rank, rank, local_rank, world_size, restart = key[:NUM_SENDER_VALUES]
    if role not in ROLES or type(host) is not str or not 0 < len(host) <= MAX_HOST_CHARS \
            or not host.isprintable():
        raise ValueError("sender role or host is not one of ours")
    sender = Sender(
        role=role, host=host, pid=bounded(pid, 0, 2**32, "pid"),
        node_rank=bounded(node_rank, -1, MAX_NODES, "node_rank"),
        rank=bounded_or_none(rank, 0, MAX_WORLD_SIZE - 1, "rank"),
        local_rank=bounded_or_none(local_rank, 0, MAX_WORLD_SIZE - 1, "local_rank"),
        world_size=bounded_or_none(world_size, 1, MAX_WORLD_SIZE, "world_size"),
        restart=bounded(restart, 0, MAX_RESTARTS, "restart"),
    )
    if (sender.rank is None) != (role != "rank") or (
            sender.world_size is not None and sender.rank is not None
            and sender.rank >= sender.world_size):
        raise ValueError("rank does not fit the role or the world size")
    return sender


def bounded(value: Any, low: int, high: int, name: str) -> int:
    """An integer in [low, high]; ValueError otherwise (a bool is not an integer here)."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} is not an integer in [{low}, {high}]")
    return value


def bounded_or_none(value: Any, low: int, high: int, name: str) -> int | None:
    return None if value is None else bounded(value, low, high, name)
