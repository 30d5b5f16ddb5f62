"""`hasctl report RESULTS... --out DIR`: plots and a table from `hasctl bench` result files.

Writes into DIR:
- goodput_vs_rate.png: request_goodput (solid) and request_throughput (dotted) against the
  request rate, one line per deployment label (results without an SLO plot throughput only);
- latency_cdf.png: TTFT and TPOT CDFs of every run (from its per-request records);
- encode_utilization.png: with --trace FILE (the JSON of the encode service's GET /trace:
  {"now": s, "buckets": [{"t": s, "encode": u, "prefill": u}, ...]}), each worker's busy
  fraction over time;
- report.md: one table row per run, and the images.
matplotlib with the Agg backend (no display needed).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from hasctl.bench import FORMAT as BENCH_FORMAT
from easerve.slo import RequestRecord

COLUMNS = (("label", "deployment"), ("request_rate", "rate (req/s)"), ("completed", "completed"),
           ("failed", "failed"), ("request_throughput", "throughput (req/s)"),
           ("request_goodput", "goodput (req/s)"), ("slo_attainment", "SLO attainment"),
           ("median_ttft_ms", "P50 TTFT (ms)"), ("p99_ttft_ms", "P99 TTFT (ms)"),
           ("median_tpot_ms", "P50 TPOT (ms)"), ("p99_tpot_ms", "P99 TPOT (ms)"))


def load_result(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {str(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); pass files written by hasctl bench --out") from None
    if not isinstance(data, dict) or data.get("format") != BENCH_FORMAT:
        raise ValueError(f"{path} is not a hasctl bench result (format {BENCH_FORMAT!r}); "
                         "pass files written by hasctl bench --out")
    data.setdefault("label", "")
    data["label"] = data["label"] or data.get("endpoint", path.stem)
    return data


def load_trace(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the trace {str(path)!r} ({e}); save GET /trace of the encode service") from None
    if not isinstance(data, dict) or not isinstance(data.get("buckets"), list):
        raise ValueError(f"{path} is not an encode /trace reply: expected an object with a 'buckets' list")
    return data


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_goodput(results: list[dict], out: Path) -> Path:
    return _save(goodput_figure(results), _plt(), out / "goodput_vs_rate.png")


def slo_text(slo: dict | None) -> str:
    return f" (SLO: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms)" if slo else ""


def goodput_figure(results: list[dict], slo: dict | None = None):
    """Goodput and throughput against the rate, one line per label; the SLO (a dict with
    ttft_ms, tpot_ms; default the first result's) in the title."""
    plt = _plt()
    slo = slo or next((r["slo"] for r in results if r.get("slo")), None)
    fig, ax = plt.subplots(figsize=(6, 4))
    by_label: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_label[r["label"]].append(r)
    for label, rs in sorted(by_label.items()):
        rs.sort(key=lambda r: r["request_rate"])
        rates = [r["request_rate"] for r in rs]
        line, = ax.plot(rates, [r["request_throughput"] for r in rs], ":", marker=".")
        if all(r.get("request_goodput") is not None for r in rs):
            ax.plot(rates, [r["request_goodput"] for r in rs], "-o", color=line.get_color(), label=f"{label} goodput")
        line.set_label(f"{label} throughput")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("req/s")
    ax.set_title("goodput vs rate" + slo_text(slo), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_cdfs(results: list[dict], out: Path) -> Path:
    return _save(cdf_figure(results), _plt(), out / "latency_cdf.png")


def cdf_figure(results: list[dict]):
    """TTFT and TPOT CDFs of every run's per-request records."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        recs = [RequestRecord.from_dict(x) for x in r.get("records", [])]
        ok = [x for x in recs if x.ok]
        name = f"{r['label']} @ {r['request_rate']:g}"
        _cdf(a, [x.ttft_s * 1e3 for x in ok], name)
        _cdf(b, [x.tpot_s * 1e3 for x in ok if x.tpot_s is not None], name)
    for ax, what in ((a, "TTFT (ms)"), (b, "TPOT (ms)")):
        ax.set_xlabel(what)
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("latency CDFs")
    return fig


def plot_trace(trace: dict, out: Path, name: str = "encode_utilization.png") -> Path:
    return _save(trace_figure(trace), _plt(), out / name)


def trace_figure(trace: dict):
    """Each encode worker's busy fraction over time, from the encode service's GET /trace."""
    plt = _plt()
    buckets = trace["buckets"]
    fig, ax = plt.subplots(figsize=(8, 3))
    if buckets:
        t0 = buckets[0]["t"]
        kinds = sorted({k for b in buckets for k in b if k != "t"})
        for k in kinds:
            ax.plot([b["t"] - t0 for b in buckets], [b.get(k, 0.0) for b in buckets], label=k)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1.05)
    ax.set_title("encode worker utilization")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    return str(v).replace("|", "\\|")


def table(results: list[dict]) -> str:
    head = "| " + " | ".join(t for _, t in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    rows = ["| " + " | ".join(_cell(r.get(k)) for k, _ in COLUMNS) + " |"
            for r in sorted(results, key=lambda r: (r["label"], r["request_rate"]))]
    return "\n".join([head, sep, *rows])


def write_report(result_paths: list[str], out_dir: str | Path, trace_paths: list[str] = ()) -> dict[str, Path]:
    results = [load_result(p) for p in result_paths]
    if not results:
        raise ValueError("give at least one bench result file")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"goodput": plot_goodput(results, out), "cdf": plot_cdfs(results, out)}
    for i, tp in enumerate(trace_paths):
        files[f"trace{i}"] = plot_trace(load_trace(tp), out, "encode_utilization.png" if i == 0
                                        else f"encode_utilization_{i}.png")
    images = "\n".join(f"![{k}]({p.name})" for k, p in files.items())
    md = f"# EAServe benchmark report\n\n{table(results)}\n\n{images}\n"
    files["markdown"] = out / "report.md"
    files["markdown"].write_text(md)
    return files


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="plots (PNG) and a markdown table from hasctl bench results")
    p.add_argument("results", nargs="+", help="hasctl bench --out files")
    p.add_argument("--trace", action="append", default=[], help="JSON of the encode service's GET /trace")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    files = write_report(args.results, args.out, args.trace)
    for p in files.values():
        print(p)
    return 0
