"""python -m services.gateway --model DIR --encode H:P --prefill H:P --decode H:P

Entry point only; the stage lives in easerve.stages.gateway.app."""
from easerve.stages.common.cli import run_stage
from easerve.stages.common.configs import GatewayConfig
from easerve.stages.gateway.app import main

if __name__ == "__main__":
    run_stage(GatewayConfig, "gateway", main)
