"""python -m services.gateway --model DIR --encode H:P --prefill H:P --decode H:P

Entry point only: parse the gateway stage's config, set up the process, serve
(`easerve.stages.gateway.app`)."""
import sys

from easerve.rpc.server import run
from easerve.stages.common.cli import setup_process
from easerve.stages.common.configs import GatewayConfig, from_argv
from easerve.stages.gateway.app import main

if __name__ == "__main__":
    cfg = from_argv(GatewayConfig, "gateway", sys.argv[1:])
    setup_process(cfg)
    run(main(cfg))
