"""The traceml version (every process): a leaf, so reading it imports nothing else."""

__version__ = "0.1.0"
