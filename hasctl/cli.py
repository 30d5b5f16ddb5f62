"""`hasctl`: Hybrid Auto Selection and operations for EAServe deployments.

Subcommands: make-tiny (random-weight checkpoints), demo (the main job on the
default tiny model), up (launch a deployment), profile (each stage's capacity alone, into a
profile file), screen (drop allocations that cannot carry a rate), bench (open-loop load
against an OpenAI-compatible endpoint), simulate (the same, predicted by the
discrete-event simulator from a profile), tune (Optuna search of allocation x B x s for the most
goodput, each trial a real launch), report (plots and a table from bench results), compose
(a compose file of a deployment), k8s (its Kubernetes manifests). Each
subcommand lives in its own module and registers itself through `add_parser(subparsers)`.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from hasctl import bench, compose, demo, k8s, profile, report, screen, simulate, tiny_cmd, tune, up_cmd

COMMANDS = [tiny_cmd, demo, up_cmd, profile, screen, bench, simulate, tune, report, compose, k8s]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hasctl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        mod.add_parser(sub)
    return p


def _sigint_interrupts() -> None:
    """A parent that ignores SIGINT (a background job of a non-interactive shell, some
    supervisors) leaves it ignored in its children, and Python then raises no KeyboardInterrupt:
    `hasctl up` and `hasctl tune` promise that SIGINT stops them cleanly, so take it back."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _sigint_interrupts()
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # config / input errors: say what to change, no traceback
        print(f"hasctl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
