"""The paper table's fit, scored held out (bench/paper_setting.py): pure functions over a table of
simulated ratios, no simulation here.

`table` maps (modality, overhead_s) to {"vllm": EAServe / vLLM-like goodput, "dynamo": EAServe /
Dynamo-like goodput} (None where the baseline's goodput is 0); `paper` is paper_setting.PAPER,
each modality's goodputs {"easerve", "vllm", "dynamo"}, whose quotients are the paper's ratios.

The error of one ratio is |log(ours / paper's)| (symmetric: 2x over and 2x under score alike;
infinite where ours is None or <= 0). The fit criterion: on a fitting set of modalities, the
overhead of the grid whose mean error over that set's ratios (two per modality) is smallest, the
smaller overhead on a tie (the roofline wins ties). A fold fits on one modality and scores the
others (held out) at the value it chose: the held-out ratios play no part in the choice.
"""
from __future__ import annotations

import math

BASELINES = ("vllm", "dynamo")


def paper_ratios(paper: dict) -> dict:
    """{modality: {"vllm": easerve / vllm, "dynamo": easerve / dynamo}} of the paper's goodputs."""
    return {m: {b: g["easerve"] / g[b] for b in BASELINES} for m, g in paper.items()}


def log_err(ours, paper: float) -> float:
    """|log(ours / paper)|; inf where ours is None or not > 0."""
    return abs(math.log(ours / paper)) if ours is not None and ours > 0 else math.inf


def mean_log_err(table: dict, paper: dict, modalities, overhead_s: float) -> float:
    """The mean |log ratio| over `modalities`' ratios (two each) at `overhead_s`."""
    want = paper_ratios(paper)
    errs = [log_err(table[(m, overhead_s)][b], want[m][b]) for m in modalities for b in BASELINES]
    return sum(errs) / len(errs) if errs else math.inf


def choose(table: dict, paper: dict, fit_on, grid) -> float:
    """The overhead of `grid` that fits `fit_on` (modalities) best: smallest mean |log ratio|, the
    smaller overhead on a tie. Reads only the fitting modalities' entries of `table`."""
    return min(grid, key=lambda x: (mean_log_err(table, paper, fit_on, x), x))


def fold(table: dict, paper: dict, fit_on: str, modalities, grid) -> dict:
    """Fit on `fit_on` alone, score the other modalities at the chosen overhead."""
    held = [m for m in modalities if m != fit_on]
    x = choose(table, paper, [fit_on], grid)
    return {"fit_on": fit_on, "overhead_s": x, "held_out": held,
            "in_sample_log_err_mean": mean_log_err(table, paper, [fit_on], x),
            "held_out_log_err_mean": mean_log_err(table, paper, held, x),
            "ratios": {m: {b: table[(m, x)][b] for b in BASELINES} for m in modalities}}


def folds(table: dict, paper: dict, modalities, grid) -> list[dict]:
    """One fold per modality (fit on it, score the rest); none with fewer than two modalities."""
    modalities = list(modalities)
    return [fold(table, paper, m, modalities, grid) for m in modalities] if len(modalities) > 1 else []


def finite(x: float, digits: int = 3):
    """`x` rounded for JSON, None where infinite."""
    return round(x, digits) if math.isfinite(x) else None


def held_out_report(table: dict, paper: dict, modalities, grid, fit_on: str) -> tuple[list[dict], dict | None]:
    """(every fold, errors rounded for JSON; the headline: the fold fitted on `fit_on`, with the
    mean held-out error over all folds), the headline None with no fold fitted on `fit_on`."""
    raw = folds(table, paper, modalities, grid)
    fs = [{**f, "in_sample_log_err_mean": finite(f["in_sample_log_err_mean"]),
           "held_out_log_err_mean": finite(f["held_out_log_err_mean"])} for f in raw]
    head = next((f for f in fs if f["fit_on"] == fit_on), None)
    if head is None:
        return fs, None
    return fs, {"held_out_log_err_mean": head["held_out_log_err_mean"], "fit_on": fit_on,
                "overhead_s": head["overhead_s"], "in_sample_log_err_mean": head["in_sample_log_err_mean"],
                "held_out": head["held_out"],
                "folds_held_out_log_err_mean": finite(sum(f["held_out_log_err_mean"] for f in raw) / len(raw)),
                "ratios": head["ratios"]}
