"""Diagnosis: stored samples -> analysis window -> findings (offline analysis).

Runs in the offline-analysis process only (end-of-run summary, `traceml
report`, `traceml.summary()`); never inside training ranks. Pure standard
library: no torch, zmq or rich. Modules, in pipeline order: ``samples`` (the
input model), ``window`` (which steps and samples count), ``stats``,
``thresholds``, ``finding``, then one rule module per report section:
``step_time``, ``step_memory``, ``process``, ``system``.
"""
