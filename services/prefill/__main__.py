"""python -m services.prefill --model DIR --decode H:P[,H:P] [--listen 127.0.0.1:50053]

Entry point only; the stage lives in easerve.stages.prefill.app."""
from easerve.stages.common import stop_early

stop_early.install()  # first: a SIGTERM while the stage imports exits 0
from easerve.stages.common.cli import run_stage  # noqa: E402
from easerve.stages.common.configs import PrefillConfig  # noqa: E402
from easerve.stages.prefill.app import main  # noqa: E402

if __name__ == "__main__":
    run_stage(PrefillConfig, "prefill", main)
