"""``python -m traceml.collector CONFIG_JSON`` (collector process)."""

import sys

from traceml.collector.server import main

sys.exit(main())
