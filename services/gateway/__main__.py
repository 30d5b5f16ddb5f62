"""python -m services.gateway --model DIR --encode H:P --prefill H:P --decode H:P

Entry point only; the stage lives in easerve.stages.gateway.app."""
from easerve.stages.common import stop_early

stop_early.install()  # first: a SIGTERM while the stage imports exits 0
from easerve.stages.common.cli import run_stage  # noqa: E402
from easerve.stages.common.configs import GatewayConfig  # noqa: E402
from easerve.stages.gateway.app import main  # noqa: E402

if __name__ == "__main__":
    run_stage(GatewayConfig, "gateway", main)
