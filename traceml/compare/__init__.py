"""Compare two runs: a noise-aware verdict between two final summaries (offline analysis).

Runs in the offline-analysis process only (``traceml compare``). Pure standard
library plus the report's schema. The pipeline, one module each:

* :mod:`~traceml.compare.load` - a path (file or session folder) -> parsed summary
* :mod:`~traceml.compare.summary` - parsed JSON -> typed :class:`RunSummary`
* :mod:`~traceml.compare.verdict` - noise-gated step time, memory, the verdict
* :mod:`~traceml.compare.build` - two summaries -> :class:`Comparison`
* :mod:`~traceml.compare.text` / :mod:`~traceml.compare.json_codec` - renderers
* :mod:`~traceml.compare.cli` - ``traceml compare A B`` (``main(argv)``)
"""

from traceml.compare.build import compare_runs
from traceml.compare.json_codec import comparison_to_json
from traceml.compare.load import load_side
from traceml.compare.model import Comparison
from traceml.compare.summary import RunSummary
from traceml.compare.text import render_text

__all__ = [
    "Comparison",
    "RunSummary",
    "compare_runs",
    "comparison_to_json",
    "load_side",
    "render_text",
]
