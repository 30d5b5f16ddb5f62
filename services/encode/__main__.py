"""python -m services.encode --model DIR (--prefill H:P | --colocate-prefill --decode H:P) [options]

Entry point only: parse the encode stage's config, set up the process, serve
(`easerve.stages.encode.app`)."""
import sys

from easerve.rpc.server import run
from easerve.stages.common.cli import setup_process
from easerve.stages.common.configs import EncodeConfig, from_argv
from easerve.stages.encode.app import main

if __name__ == "__main__":
    cfg = from_argv(EncodeConfig, "encode", sys.argv[1:])
    setup_process(cfg)
    run(main(cfg))
