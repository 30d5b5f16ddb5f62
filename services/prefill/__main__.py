"""python -m services.prefill --model DIR --decode H:P[,H:P] [--listen 127.0.0.1:50053]

Entry point only; the stage lives in easerve.stages.prefill.app."""
from easerve.stages.common.cli import run_stage
from easerve.stages.common.configs import PrefillConfig
from easerve.stages.prefill.app import main

if __name__ == "__main__":
    run_stage(PrefillConfig, "prefill", main)
