"""python -m hasctl.standby READY_FILE MODULE [ARGS...]: a stage process started ahead of need.

It imports MODULE's entry point (torch, transformers, the stage's code: most of a cold
start), creates READY_FILE, and then waits on stdin. On the line "go" it runs
`python -m MODULE ARGS...` in this process; on end of input (its launcher is gone or
stopping) it exits. `hasctl.launch.Stack`
with `standby=True` keeps one per stage process and promotes it when the process dies, so
a restart skips the imports.
"""
from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[1].startswith("services."):
        print("usage: python -m hasctl.standby READY_FILE services.<stage> [ARGS...]", file=sys.stderr)
        return 2
    ready, module, args = Path(argv[0]), argv[1], argv[2:]
    importlib.import_module(module + ".__main__")
    ready.touch()
    if sys.stdin.readline().strip() != "go":
        return 0
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
