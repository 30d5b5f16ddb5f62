"""python -m services.monolith --model DIR [--listen 127.0.0.1:50052] [engine flags]

Entry point only; the stage lives in easerve.stages.monolith.app."""
from easerve.stages.common.cli import run_stage
from easerve.stages.common.configs import MonolithConfig
from easerve.stages.monolith.app import main

if __name__ == "__main__":
    run_stage(MonolithConfig, "monolith", main)
