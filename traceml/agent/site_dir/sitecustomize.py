"""traceml's bootstrap: the only file in the directory that ``traceml run``
prepends to the workers' PYTHONPATH.

It removes that directory from ``sys.path`` again (so nothing else becomes
importable through it), runs the ``sitecustomize`` it displaced, if any, and
lets the agent decide whether this process is a training rank to arm.
"""

import importlib
import os
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_displaced() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            traceback.print_exc()
    except Exception:
        traceback.print_exc()
    if "sitecustomize" not in sys.modules and ours is not None:
        sys.modules["sitecustomize"] = ours


def _arm() -> None:
    try:
        from traceml.agent import activate
    except Exception as exc:  # traceml not importable here: stay inert
        print(f"traceml: warning: agent not armed: {exc!r}", file=sys.stderr)
        return
    activate.main()


_chain_displaced()
_arm()
