"""The ImportError an integration raises when its framework is missing (user process)."""

from __future__ import annotations

# What each of traceml-run's extras installs (pyproject.toml's optional-dependencies).
EXTRAS = {
    "hf": ("transformers>=4.41", "accelerate>=0.30"),
    "lightning": ("lightning>=2.1",),
    "wandb": ("wandb>=0.16",),
    "mlflow": ("mlflow-skinny>=2.10",),
    "ray": ("ray[train]>=2.60",),
}


def missing_framework(module: str, framework: str, extra: str) -> ImportError:
    """``raise missing_framework(...) from exc``: says which pip command to run.  It names
    the packages themselves, which install the same whether traceml came from a clone
    or an index."""
    packages = " ".join(f"'{requirement}'" for requirement in EXTRAS[extra])
    return ImportError(
        f"traceml.integrations.{module} needs {framework}, which is not installed: "
        f"pip install {packages} (traceml-run's '{extra}' extra)"
    )
