"""python -m services.prefill --model DIR --decode H:P[,H:P] [--listen 127.0.0.1:50053]

Entry point only: parse the prefill stage's config, set up the process, serve
(`easerve.stages.prefill.app`)."""
import sys

from easerve.rpc.server import run
from easerve.stages.common.cli import setup_process
from easerve.stages.common.configs import PrefillConfig, from_argv
from easerve.stages.prefill.app import main

if __name__ == "__main__":
    cfg = from_argv(PrefillConfig, "prefill", sys.argv[1:])
    setup_process(cfg)
    run(main(cfg))
