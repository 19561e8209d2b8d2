"""Live views and the page renderer: what a run looks like while it goes.

* :mod:`traceml.live.tail` reads the growing store once a second, bounded;
* :mod:`traceml.live.snapshot` turns stored rows and a Report into a Snapshot,
  with :mod:`~traceml.live.series` (chart data) and :mod:`~traceml.live.gauges`;
* :mod:`traceml.live.terminal` renders a Snapshot with rich (``--mode=cli``,
  launcher process, driven by :mod:`traceml.live.console`, started by
  :mod:`traceml.live.views`, worker output from :mod:`traceml.live.worker_output`);
* :mod:`traceml.live.dashboard` serves the page and snapshots over HTTP
  (``--mode=dashboard``, a thread of the collector process);
* :mod:`traceml.live.page` is the browser page (``static/``), shared with
  final_summary.html (:mod:`traceml.report.html`).
"""
