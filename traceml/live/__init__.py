"""Live views: what a run looks like while it goes.

They draw the page model (:mod:`traceml.report.page`: the Snapshot, its series
and gauges, and the browser page), which sits beside the report it renders.

* :mod:`traceml.live.tail` reads the growing store once a second, bounded;
* :mod:`traceml.live.terminal` renders a Snapshot with rich (``--mode=cli``,
  launcher process, driven by :mod:`traceml.live.console`, started by
  :mod:`traceml.live.views`, worker output from :mod:`traceml.live.worker_output`);
* :mod:`traceml.live.dashboard` serves the page (:mod:`traceml.report.page.render`)
  and snapshots over HTTP (``--mode=dashboard``, a thread of the collector process).
"""
