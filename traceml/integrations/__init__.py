"""Optional integrations with the frameworks people train with (user process).

Each module needs its framework, installed with an extra; ``import traceml``
never imports this package:

* :mod:`traceml.integrations.huggingface` - ``TraceMLCallback`` for
  ``transformers.Trainer`` (the ``hf`` extra).
* :mod:`traceml.integrations.lightning` - ``TraceMLCallback`` for the
  Lightning ``Trainer`` (the ``lightning`` extra).
* :mod:`traceml.integrations.wandb` - ``log_summary`` to a W&B run
  (the ``wandb`` extra).
* :mod:`traceml.integrations.mlflow` - ``log_summary`` to an MLflow run
  (the ``mlflow`` extra).
* :mod:`traceml.integrations.ray` - ``fit`` traces every worker of a Ray Train
  ``TorchTrainer`` (the ``ray`` extra).

The zero-code agent already sees these frameworks' steps under ``traceml
run``; the callbacks only make the boundaries exact (one step = one
optimizer step, whatever the framework does between steps).
"""
