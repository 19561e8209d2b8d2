"""Live views and the page renderer: what a run looks like while it goes.

* :mod:`traceml.live.tail` reads the growing store once a second, bounded;
* :mod:`traceml.live.snapshot` turns stored rows and a Report into a Snapshot;
* :mod:`traceml.live.terminal` renders a Snapshot with rich (``--mode=cli``,
  launcher process, driven by :mod:`traceml.live.console`);
* :mod:`traceml.live.dashboard` serves the page and snapshots over HTTP
  (``--mode=dashboard``, collector process);
* :mod:`traceml.live.page` is the browser page, shared with final_summary.html.
"""
