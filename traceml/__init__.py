"""traceml: a torchrun drop-in that tells you why PyTorch training is slow.

``import traceml`` is cheap: it imports neither torch, zmq nor rich.
"""

from __future__ import annotations

from traceml.api import init, summary, trace_step
from traceml.version import __version__

__all__ = ["__version__", "init", "summary", "trace_step"]
