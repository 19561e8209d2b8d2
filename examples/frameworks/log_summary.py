"""Log a finished traceml session to W&B or MLflow:

    python examples/frameworks/log_summary.py logs/<session> --to wandb
    python examples/frameworks/log_summary.py logs/<session> --to mlflow

Logs the flat ``traceml/...`` metrics, ``traceml/verdict`` and the
final_summary.{json,txt,html} files of the session into a new run.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("session", help="logs/<session> or its final_summary.json")
    parser.add_argument("--to", choices=["wandb", "mlflow"], required=True)
    args = parser.parse_args()
    if args.to == "wandb":
        from traceml.integrations.wandb import log_summary
    else:
        from traceml.integrations.mlflow import log_summary  # type: ignore[assignment]
    print(f"logged to {args.to} run {log_summary(args.session)}")


if __name__ == "__main__":
    main()
