"""python -m services.decode --model DIR [--listen 127.0.0.1:50054] [--num-slots 64 --max-seq-len 2048]

Entry point only; the stage lives in easerve.stages.decode.app."""
from easerve.stages.common import stop_early

stop_early.install()  # first: a SIGTERM while the stage imports exits 0
from easerve.stages.common.cli import run_stage  # noqa: E402
from easerve.stages.common.configs import DecodeConfig  # noqa: E402
from easerve.stages.decode.app import main  # noqa: E402

if __name__ == "__main__":
    run_stage(DecodeConfig, "decode", main)
