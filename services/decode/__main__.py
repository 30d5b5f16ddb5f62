"""python -m services.decode --model DIR [--listen 127.0.0.1:50054] [--num-slots 64 --max-seq-len 2048]

Entry point only: parse the decode stage's config, set up the process, serve
(`easerve.stages.decode.app`)."""
import sys

from easerve.rpc.server import run
from easerve.stages.common.cli import setup_process
from easerve.stages.common.configs import DecodeConfig, from_argv
from easerve.stages.decode.app import main

if __name__ == "__main__":
    cfg = from_argv(DecodeConfig, "decode", sys.argv[1:])
    setup_process(cfg)
    run(main(cfg))
