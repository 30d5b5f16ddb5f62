"""`hasctl`: Hybrid Auto Selection and operations for EAServe deployments.

Subcommands: make-tiny (random-weight checkpoints), demo (the main job on the
default tiny model), up (launch a deployment), profile (each stage's capacity alone, into a
profile file), screen (drop allocations that cannot carry a rate), bench (open-loop load
against an OpenAI-compatible endpoint), simulate (the same, predicted by the
discrete-event simulator from a profile), tune (Optuna search of allocation x B x s for the most
goodput, each trial a real launch), report (plots and a table from bench results), compose
(a compose file of a deployment), k8s (its Kubernetes manifests). Each
subcommand lives in its own module and registers itself through `add_parser(subparsers)`;
only the module of the command being run is imported (make-tiny's pulls in torch and
transformers, which `simulate` or `compose` never need).
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

# command -> the hasctl module that defines it (its add_parser registers that name)
COMMANDS = {"make-tiny": "tiny_cmd", "demo": "demo", "up": "up_cmd", "profile": "profile", "screen": "screen",
            "bench": "bench", "simulate": "simulate", "tune": "tune", "report": "report", "compose": "compose",
            "k8s": "k8s"}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv` naming a command, only that command's module is imported."""
    p = argparse.ArgumentParser(prog="hasctl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    wanted = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    for name in wanted:
        importlib.import_module(f"hasctl.{COMMANDS[name]}").add_parser(sub)
    return p


def _sigint_interrupts() -> None:
    """A parent that ignores SIGINT (a background job of a non-interactive shell, some
    supervisors) leaves it ignored in its children, and Python then raises no KeyboardInterrupt:
    `hasctl up` and `hasctl tune` promise that SIGINT stops them cleanly, so take it back."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    _sigint_interrupts()
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # config / input errors: say what to change, no traceback
        print(f"hasctl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
