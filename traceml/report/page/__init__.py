"""The page model: a Snapshot of the report and the browser page that draws it.

Runs wherever a view is built: offline analysis (final_summary.html,
:mod:`traceml.report.html`), the collector (the dashboard,
:mod:`traceml.live.dashboard`) and the launcher (the terminal view,
:mod:`traceml.live.terminal`). It sits beside the report it renders, so the
report never imports :mod:`traceml.live`; the live views import it from here.

* :mod:`traceml.report.page.snapshot` turns stored rows and a Report into a
  Snapshot, with :mod:`~traceml.report.page.series` (chart data) and
  :mod:`~traceml.report.page.gauges`;
* :mod:`traceml.report.page.render` is the browser page (``static/``: HTML,
  CSS, JS), the one file both final_summary.html and the dashboard serve.
"""
