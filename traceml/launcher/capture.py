"""``traceml capture SESSION_DIR --rank R [--steps K]``: ask a live run for a profiler
capture of one rank and the median rank, then print what it found (launcher side).

The request goes to node 0's collector with the key the launcher wrote to the session
folder (``capture.key``, readable by its owner alone): the collector takes what arrives
with that key as a capture request and nothing else, and refuses any other key's
handshake.  The collector plans the capture as it plans an automatic one
(`traceml.live.captures`); this command then reads the store until the ranks reported.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
import zmq

from traceml.config import DEFAULT_CAPTURE_STEPS, UsageErrorParser
from traceml.diagnosis.operators import CaptureResult, capture_results
from traceml.errors import UsageError
from traceml.launcher.args import capture_steps, number_in
from traceml.launcher.collector_process import CAPTURE_KEY_FILENAME
from traceml.records import Capture
from traceml.security import client_keys_from, secure_client
from traceml.store import STORE_FILENAME, StoreError, StoreReader
from traceml.wire.captures import MAX_CAPTURE_STEPS


class CaptureFailed(UsageError):
    """The request went out, and no capture came of it."""

    exit_code = 1


ASKED_WITHIN_S = 10.0  # the collector stores the ask within this, or did not take it
POLL_S = 0.25


def build_parser() -> argparse.ArgumentParser:
    parser = UsageErrorParser(prog="traceml capture", description=(
        "Ask a running 'traceml run' to profile the same steps on RANK and on the median "
        "rank with torch.profiler, and print the operators that differ (the run's summary "
        "shows them too)."))
    parser.add_argument("session_dir", help="The live run's session folder (logs/<session>).")
    parser.add_argument("--rank", type=int, required=True, help="The rank to profile.")
    parser.add_argument("--steps", type=capture_steps, default=DEFAULT_CAPTURE_STEPS,
                        help=f"Steps to profile (default {DEFAULT_CAPTURE_STEPS}, at most "
                             f"{MAX_CAPTURE_STEPS}).")
    parser.add_argument("--wait", type=number_in(1.0, 3600.0, "seconds"), default=120.0,
                        metavar="SEC",
                        help="Seconds to wait for the ranks' reports (default 120).")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    session = Path(args.session_dir)
    endpoint, keys = _read_key(session)
    world = _live_world(session)
    if not 0 <= args.rank < max(world, 1):
        raise UsageError(f"traceml capture: --rank {args.rank}: the run has ranks 0 to "
                         f"{world - 1}")
    asked_at = time.time()
    _send(endpoint, keys, {"op": "capture", "rank": args.rank, "steps": args.steps})
    capture_id = _wait_for_ask(session, args.rank, asked_at)
    print(f"traceml: capture {capture_id} asked of r{args.rank}; waiting for its steps",
          file=sys.stderr)
    result = _wait_for_reports(session, capture_id, args.wait)
    if result is None:
        raise CaptureFailed(f"traceml capture: no report from the ranks within "
                            f"{args.wait:.0f} s; the run's summary will show the capture if "
                            "it ran")
    from traceml.report.text import capture_lines

    print("\n".join(capture_lines(result)))
    return 0


def _read_key(session: Path) -> tuple[str, str]:
    path = session / CAPTURE_KEY_FILENAME
    try:
        obj = orjson.loads(path.read_bytes())
        return str(obj["endpoint"]), str(obj["keys"])
    except FileNotFoundError:
        raise UsageError(f"traceml capture: {path} does not exist: give the folder of a run "
                         "'traceml run' started (its node 0)") from None
    except PermissionError:
        raise UsageError(f"traceml capture: {path} is not readable by you: only the user "
                         "who started the run may ask for a capture") from None
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"traceml capture: {path} cannot be read ({exc})") from None


def _live_world(session: Path) -> int:
    """The run's world size; UsageError when the run is over."""
    try:
        with StoreReader(session / STORE_FILENAME) as reader:
            records = reader.records()
    except StoreError as exc:
        raise UsageError(f"traceml capture: cannot read {session / STORE_FILENAME}: {exc}"
                         ) from None
    if records.end is not None:
        raise UsageError(f"traceml capture: the run of {session} has ended: a capture "
                         "profiles a live run") from None
    sizes = [s.sender.world_size for s in records.senders if s.sender.world_size]
    return max(sizes, default=0)


def _send(endpoint: str, keys_text: str, request: dict[str, object]) -> None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(ASKED_WITHIN_S * 1000))
        secure_client(sock, client_keys_from(keys_text))
        sock.connect(endpoint)
        sock.send(orjson.dumps(request))
        sock.close()
    except ValueError as exc:
        raise UsageError(f"traceml capture: the session's key is malformed ({exc})") from None
    finally:
        context.term()


def _wait_for_ask(session: Path, rank: int, asked_at: float) -> str:
    deadline = time.monotonic() + ASKED_WITHIN_S
    while time.monotonic() < deadline:
        for c in _captures(session):
            if c.trigger == "manual" and c.role == "suspect" and c.rank == rank \
                    and c.asked_at >= asked_at - 1.0:
                return c.capture_id
        time.sleep(POLL_S)
    raise CaptureFailed(f"traceml capture: the collector did not take the request within "
                        f"{ASKED_WITHIN_S:.0f} s: the run ended, rank {rank} has no step yet, "
                        "or it runs on another node than the collector's (captures reach the "
                        "ranks of the collector's node only)")


def _wait_for_reports(session: Path, capture_id: str, wait_s: float) -> CaptureResult | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        rows = [c for c in _captures(session) if c.capture_id == capture_id]
        if rows and all(c.reported_at is not None for c in rows):
            return capture_results(rows)[0]
        time.sleep(POLL_S)
    return None


def _captures(session: Path) -> tuple[Capture, ...]:
    try:
        with StoreReader(session / STORE_FILENAME) as reader:
            return reader.captures()
    except StoreError:
        return ()
