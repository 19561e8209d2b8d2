"""Print the worker's environment and sys.path, one entry per line.

With ENV_DUMP_DIR set, each rank writes its lines to rank<RANK>.txt there
instead: ranks printing to one pipe interleave their buffered blocks mid-line
once the environment passes a pipe buffer.
"""

import os
import sys
from pathlib import Path

import torch  # noqa: F401  (arms the agent, which waits for torch)

lines = [f"{key}={os.environ[key]}" for key in sorted(os.environ)]
lines += [f"path:{p}" for p in sys.path]
lines.append(f"ppid={os.getppid()}")
text = "\n".join(lines) + "\n"
dump_dir = os.environ.get("ENV_DUMP_DIR")
if dump_dir:
    Path(dump_dir, f"rank{os.environ['RANK']}.txt").write_text(text)
else:
    sys.stdout.write(text)
