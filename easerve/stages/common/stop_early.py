"""A stage process asked to stop (SIGTERM) before it serves exits 0: no call was accepted yet, so
nothing is left to drain, as after a drain that finished. Each `services.<stage>` entry point
calls `install()` before its imports (torch and the model code take seconds); the handler holds
through `run_stage` until `easerve.rpc.server.serve()` puts the draining one in its place, before
its first call is read."""
from __future__ import annotations

import logging
import signal


def _exit(signum, frame) -> None:
    logging.getLogger("easerve.stage").info("SIGTERM before serving: nothing accepted, exiting")
    raise SystemExit(0)


def install() -> None:
    signal.signal(signal.SIGTERM, _exit)
