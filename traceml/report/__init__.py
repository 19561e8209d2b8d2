"""Report: findings -> one Report model -> text card and final_summary.json (offline analysis).

Runs in the offline-analysis process only. Pure standard library. Entry points:

* :func:`build_report` - RunData -> Report
* :func:`render_text` - Report -> final_summary.txt
* :func:`report_to_json` - Report -> final_summary.json data
* :func:`flatten_summary` - final_summary.json data -> ``{"traceml/...": value}``
* :func:`validate_summary` - problems of a final_summary.json document
"""

from traceml.report.build import build_report
from traceml.report.json_codec import flatten_summary, report_to_json
from traceml.report.model import SCHEMA_VERSION, Report, Section
from traceml.report.schema import validate_summary
from traceml.report.text import render_text

__all__ = [
    "SCHEMA_VERSION",
    "Report",
    "Section",
    "build_report",
    "flatten_summary",
    "render_text",
    "report_to_json",
    "validate_summary",
]
