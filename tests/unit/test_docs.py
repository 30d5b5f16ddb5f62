"""The docs stay true to the code and the stored results: the generated pages (configuration,
metrics, the Grafana dashboard, benchmarks, the README's table) equal what scripts/gen_docs.py
makes now, every page is linked from docs/index.md, every relative link resolves, the README
stays a landing page, every figure in the benchmark tables, and every measurement the README and
the docs quote outside docs/history/, is a value of a stored result file,
every `easerve:` metric the library defines is documented, and the troubleshooting page quotes
messages the code emits."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _load(name: str):
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "scripts"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def gen_docs():
    return _load("gen_docs")


@pytest.fixture(scope="module")
def bench_results():
    return _load("bench_results")


def _readme_table() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"<!-- BENCHMARKS:BEGIN.*?-->(.*?)<!-- BENCHMARKS:END -->", readme, re.S).group(1)


def test_generated_pages_are_up_to_date(gen_docs):
    stale = [path.relative_to(ROOT).as_posix() for path, text in gen_docs.pages().items()
             if not path.exists() or path.read_text() != text]
    assert stale == [], f"stale, run `python scripts/gen_docs.py`: {stale}"


def test_every_docs_page_is_linked_from_the_index():
    index = DOCS / "index.md"
    linked = {(index.parent / target.split("#")[0]).resolve() for target in LINK.findall(index.read_text())}
    pages = {p.resolve() for p in DOCS.rglob("*.md")} - {index.resolve()}
    assert sorted(str(p.relative_to(DOCS)) for p in pages - linked) == []


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for target in LINK.findall(page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    assert not re.search(r"\bissue \d+|\(issue|#\d{1,3}\b", readme), "the README names issue numbers"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "the README carries dated history (docs/history/)"


def _stored_numbers() -> set[str]:
    texts = [p.read_text() for p in RESULTS.rglob("*") if p.suffix in (".json", ".jsonl")]
    return set(NUMBER.findall("\n".join(texts)))


def test_every_benchmark_figure_comes_from_a_stored_result():
    stored = _stored_numbers()
    for name, text in (("README.md's table", _readme_table()), ("docs/benchmarks.md", (DOCS / "benchmarks.md").read_text())):
        unsourced = sorted(set(NUMBER.findall(text)) - stored)
        assert unsourced == [], f"{name} quotes figures no file under bench/results/ holds: {unsourced}"
    assert NUMBER.findall(_readme_table()), "the README's benchmarks table quotes no figure"


# A quoted measurement in prose: a decimal number with a unit of measure ("654.2 ms", "1.39x",
# "15.4 req/s"); in a table row, any number with two or more decimals ("0.338"). Parameters are
# written as round numbers or with one decimal ("0.5 s", "share 1.0") and are not figures.
MEASURED = re.compile(r"(?<![\w.])(\d[\d,]*\.\d+)\s?(?:ms|req/s|tok/s|GB/s|MB/s|Gb/s|core-ms|x|%)(?![\w/])")
TABLE_FIGURE = re.compile(r"(?<![\w.])(\d+\.\d{2,})(?![\w.])")
GENERATED = {"configuration.md", "metrics.md", "benchmarks.md"}  # reference pages / checked above


def quoted_figures(text: str) -> set[str]:
    found = set(MEASURED.findall(text))
    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            found |= set(TABLE_FIGURE.findall(line))
    return {f.replace(",", "") for f in found}


def test_quoted_figures_are_found_in_prose_and_tables():
    text = "TTFT 654.2 ms, 1.39x the peer, 15.4 req/s; a 0.5 s pause at share 1.0\n| a | 0.338 | 2 |"
    assert quoted_figures(text) == {"654.2", "1.39", "15.4", "0.338"}


def test_no_page_quotes_a_measurement_that_no_stored_result_holds():
    """Outside docs/history/ (dated runs, kept for their notes) and the generated pages, every
    measured figure the README and the docs quote is a value of a file under bench/results/."""
    stored = {n.lstrip("-") for n in _stored_numbers()}
    pages = [ROOT / "README.md"] + [p for p in DOCS.rglob("*.md") if "history" not in p.relative_to(DOCS).parts
                                    and p.name not in GENERATED]
    for page in pages:
        unsourced = sorted(quoted_figures(page.read_text()) - stored)
        assert unsourced == [], (f"{page.relative_to(ROOT)} quotes {unsourced}, which no file under bench/results/ "
                                 "holds: store the run that measured it, or move the passage to docs/history/")


def _defined_metrics() -> set[str]:
    """Every metric name the library passes to a prometheus_client constructor (a plain text scan,
    independent of the generator's AST walk)."""
    src = "\n".join(p.read_text() for p in (ROOT / "easerve").rglob("*.py"))
    return set(re.findall(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"(easerve:[a-z_:]+)\"", src))


def test_every_registered_metric_is_documented_and_on_the_dashboard():
    defined = _defined_metrics()
    assert len(defined) >= 40, defined
    documented = set(re.findall(r"^\| `(easerve:[a-z_:]+)` \|", (DOCS / "metrics.md").read_text(), re.M))
    board = json.loads((DOCS / "grafana" / "easerve.json").read_text())
    plotted = {p["title"] for p in board["panels"] if p["type"] == "timeseries"}
    assert sorted(defined - documented) == [], "metrics missing from docs/metrics.md"
    assert sorted(defined - plotted) == [], "metrics missing from docs/grafana/easerve.json"


def test_troubleshooting_quotes_messages_the_code_emits():
    src = "\n".join(p.read_text() for top in ("easerve", "hasctl") for p in (ROOT / top).rglob("*.py"))
    quoted = [frag for line in (DOCS / "troubleshooting.md").read_text().splitlines() if line.startswith("| `")
              for frag in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    assert len(quoted) >= 20
    assert [q for q in quoted if q not in src] == []


def test_a_stored_result_becomes_a_row_with_its_figures_command_and_plots(bench_results, tmp_path):
    run = tmp_path / "pipeline"
    run.mkdir()
    (run / "goodput.png").write_bytes(b"\x89PNG")
    (run / "result.json").write_text(json.dumps({
        "bench": "pipeline", "command": "python bench/pipeline.py --rates 1,4", "commit": "abc123",
        "machine": {"cpu": "2-core EPYC"}, "date": "2026-12-04T17:00:00Z",
        "result": {"stack_over_monolith_goodput": 1.24, "stack_over_vllm_goodput": 8.5, "worst_rate": 4,
                   "per_rate": {"4": 1.62}}}))
    row = bench_results.readme_table(tmp_path).splitlines()[2]
    assert row == ("| [pipeline](bench/results/pipeline/result.json) | `stack_over_monolith_goodput` 1.24; "
                   "`stack_over_vllm_goodput` 8.5; `worst_rate` 4 | "
                   "[goodput.png](bench/results/pipeline/goodput.png) |")
    page = bench_results.benchmarks_md(tmp_path)
    for expected in ("| `per_rate.4` | 1.62 |", "- command: `python bench/pipeline.py --rates 1,4`",
                     "- commit: `abc123`", "- machine: cpu: 2-core EPYC", "- date: 2026-12-04T17:00:00Z",
                     "[goodput.png](../bench/results/pipeline/goodput.png)"):
        assert expected in page


def test_a_result_without_its_command_is_refused(bench_results, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "result.json").write_text(json.dumps({"bench": "x", "result": {}}))
    with pytest.raises(ValueError, match="missing command, commit, date, machine"):
        bench_results.load_results(tmp_path)
