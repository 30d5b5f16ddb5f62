"""python -m services.monolith --model DIR [--listen 127.0.0.1:50052] [engine flags]

Entry point only; the stage lives in easerve.stages.monolith.app."""
from easerve.stages.common import stop_early

stop_early.install()  # first: a SIGTERM while the stage imports exits 0
from easerve.stages.common.cli import run_stage  # noqa: E402
from easerve.stages.common.configs import MonolithConfig  # noqa: E402
from easerve.stages.monolith.app import main  # noqa: E402

if __name__ == "__main__":
    run_stage(MonolithConfig, "monolith", main)
