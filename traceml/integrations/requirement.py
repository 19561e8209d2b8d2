"""The ImportError an integration raises when its framework is missing (user process)."""

from __future__ import annotations


def missing_framework(module: str, framework: str, extra: str) -> ImportError:
    """``raise missing_framework(...) from exc``: says which pip command to run."""
    return ImportError(
        f"traceml.integrations.{module} needs {framework}, which is not installed: "
        f"pip install 'traceml-ai[{extra}]'"
    )
