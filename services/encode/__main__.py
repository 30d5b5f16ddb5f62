"""python -m services.encode --model DIR (--prefill H:P | --colocate-prefill --decode H:P) [options]

Entry point only; the stage lives in easerve.stages.encode.app."""
from easerve.stages.common import stop_early

stop_early.install()  # first: a SIGTERM while the stage imports exits 0
from easerve.stages.common.cli import run_stage  # noqa: E402
from easerve.stages.common.configs import EncodeConfig  # noqa: E402
from easerve.stages.encode.app import main  # noqa: E402

if __name__ == "__main__":
    run_stage(EncodeConfig, "encode", main)
