"""python -m services.monolith --model DIR [--listen 127.0.0.1:50052] [engine flags]

Entry point only: parse the monolith stage's config, set up the process, serve
(`easerve.stages.monolith.app`)."""
import sys

from easerve.rpc.server import run
from easerve.stages.common.cli import setup_process
from easerve.stages.common.configs import MonolithConfig, from_argv
from easerve.stages.monolith.app import main

if __name__ == "__main__":
    cfg = from_argv(MonolithConfig, "monolith", sys.argv[1:])
    setup_process(cfg)
    run(main(cfg))
