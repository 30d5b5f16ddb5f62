"""python -m services.encode --model DIR (--prefill H:P | --colocate-prefill --decode H:P) [options]

Entry point only; the stage lives in easerve.stages.encode.app."""
from easerve.stages.common.cli import run_stage
from easerve.stages.common.configs import EncodeConfig
from easerve.stages.encode.app import main

if __name__ == "__main__":
    run_stage(EncodeConfig, "encode", main)
