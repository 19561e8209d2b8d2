"""Print the worker's environment and sys.path, one entry per line."""

import os
import sys

import torch  # noqa: F401  (arms the agent, which waits for torch)

for key in sorted(os.environ):
    print(f"{key}={os.environ[key]}")
for p in sys.path:
    print(f"path:{p}")
print(f"ppid={os.getppid()}")
