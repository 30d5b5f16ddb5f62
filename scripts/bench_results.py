"""Read the stored benchmark results and render them: docs/benchmarks.md and the README's table.

A bench that the docs quote stores its run in `bench/results/<bench>/result.json`:

    {"bench": "pipeline", "command": "python bench/pipeline.py ...", "commit": "<git sha>",
     "machine": {...}, "date": "2026-12-04T17:00:00Z", "result": {<the bench's last-line JSON>}}

with its plots (`*.png`) beside it. `bench/results/gpu-check/` holds the GPU check's own files
instead (`easerve.gpu-check/1` JSON, a decode JSONL and a README); it gets a section of its own.
Every figure printed here is a value of those files, written as the file has it (no rounding),
so a test can trace each number back to a stored result.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GPU_CHECK = "gpu-check"
BEGIN, END = "<!-- BENCHMARKS:BEGIN (scripts/gen_docs.py) -->", "<!-- BENCHMARKS:END -->"
README_FIGURES = 3   # headline figures per bench in the README
DOC_FIGURES = 16     # and in docs/benchmarks.md
# the GPU check's figures the README quotes: (label, file, path into it)
GPU_README = (("e2e requests answered", "run4-e2e-transformers-5.24.json", "sections.e2e.result.answered"),
              ("of", "run4-e2e-transformers-5.24.json", "sections.e2e.result.requests"),
              ("e2e TTFT median ms", "run4-e2e-transformers-5.24.json", "sections.e2e.result.ttft_ms_median"),
              ("encode SMs at share 0.5", "run1-full-transformers-5.17.json",
               "sections.green_contexts.result.levels.0.5.encode_sms"),
              ("decode engine / HF tok/s at batch 1", "run4-decode-transformers-5.24.jsonl", "0.engine_over_hf_b1"))


def value(v) -> str:
    """A stored value as the file writes it."""
    return json.dumps(v) if not isinstance(v, str) else v


def scalars(obj, prefix: str = "", depth: int = 2) -> list[tuple[str, object]]:
    """The scalar leaves of a result, in its order (ratios first, as the benches print them),
    nested dicts flattened to `a.b` up to `depth` levels; lists and long strings left out."""
    out = []
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth > 1:
            out += scalars(v, key + ".", depth - 1)
        elif isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 40):
            out.append((key, v))
    return out


def figures(obj, limit: int) -> str:
    return "; ".join(f"`{k}` {value(v)}" for k, v in scalars(obj)[:limit]) or "-"


def load_results(root: Path = RESULTS) -> list[dict]:
    """Every `<bench>/result.json`, sorted by bench, with its folder and plots added."""
    out = []
    for path in sorted(root.glob("*/result.json")):
        r = json.loads(path.read_text())
        missing = {"bench", "command", "commit", "machine", "date", "result"} - set(r)
        if missing:
            raise ValueError(f"{path}: missing {', '.join(sorted(missing))} (the schema: scripts/bench_results.py)")
        r["folder"] = f"bench/results/{path.parent.name}"  # where it is linked from the README and docs/
        r["plots"] = sorted(p.name for p in path.parent.glob("*.png"))
        out.append(r)
    return out


def machine_text(machine) -> str:
    if isinstance(machine, dict):
        return "; ".join(f"{k}: {value(v)}" for k, v in machine.items())
    return str(machine)


def _get(obj, path: str):
    for part in _split_path(path):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def _split_path(path: str) -> list[str]:
    """'levels.0.5.encode_sms' -> ['levels', '0.5', 'encode_sms'] (a key may hold a dot: '0.5')."""
    return re.findall(r"\d+\.\d+(?=\.|$)|[^.]+", path)


def gpu_files(root: Path = RESULTS / GPU_CHECK) -> dict[str, object]:
    """name -> parsed content (a JSONL file: its list of records)."""
    files: dict[str, object] = {}
    for path in sorted(root.glob("*.json")):
        files[path.name] = json.loads(path.read_text())
    for path in sorted(root.glob("*.jsonl")):
        files[path.name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return files


def _first_words(text: str, limit: int = 160) -> str:
    """A failure's last line (the exception), cut between words (never inside a number)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    text = " ".join(lines[-1].split()) if lines else ""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def _pick(files: dict[str, object], spec: tuple[tuple[str, str, str], ...]) -> list[tuple[str, object]]:
    return [(label, _get(files[name], path)) for label, name, path in spec if name in files]


# ---- docs/benchmarks.md ----------------------------------------------------------------------
def _bench_section(r: dict, link_prefix: str) -> list[str]:
    folder = f"{link_prefix}{r['folder']}"
    plots = ", ".join(f"[{p}]({folder}/{p})" for p in r["plots"]) or "-"
    rows = [f"## {r['bench']}\n", "| figure | value |", "| --- | --- |"]
    rows += [f"| `{k}` | {value(v)} |" for k, v in scalars(r["result"])[:DOC_FIGURES]]
    rows += ["", f"- command: `{r['command']}`", f"- commit: `{r['commit']}`",
             f"- machine: {machine_text(r['machine'])}", f"- date: {r['date']}",
             f"- stored result: [{r['folder']}/result.json]({folder}/result.json); plots: {plots}", ""]
    return rows


def _gpu_section(files: dict[str, object], link_prefix: str) -> list[str]:
    folder = f"{link_prefix}bench/results/{GPU_CHECK}"
    out = ["## GPU check (one H200)\n", f"What each run showed, with its command: [{GPU_CHECK}/README.md]"
           f"({folder}/README.md). The figures below are read from the files in that folder.\n",
           "| file | section | status | seconds | figures |", "| --- | --- | --- | --- | --- |"]
    for name, content in files.items():
        link = f"[{name}]({folder}/{name})"
        if isinstance(content, dict):
            for section, s in content.get("sections", {}).items():
                result = s.get("result") if isinstance(s.get("result"), dict) else {}
                shown = "; ".join(f"`{k}` {value(v)}" for k, v in scalars(result, depth=3)[:8]) or "-"
                if s.get("error"):
                    shown += f"; error: {cell(_first_words(s['error']))}"
                out.append(f"| {link} | {section} | {s.get('status', '')} | {value(s.get('seconds', ''))} | "
                           f"{shown} |")
        else:
            for rec in content:
                out.append(f"| {link} | decode ({rec.get('backend', '')}) | ok | - | {figures(rec, 8)} |")
    return out + [""]


def benchmarks_md(root: Path = RESULTS) -> str:
    out = ["<!-- Generated by scripts/gen_docs.py from bench/results/; edit the source, then run it. -->\n",
           "# Benchmarks\n",
           "Each bench compares against a baseline measured in the same run and prints one JSON line last",
           "(ratios first). The runs below are the stored ones: `bench/results/<bench>/result.json` holds the",
           "command, the commit, the machine, the date and that last line, with its plots beside it. Older",
           "runs, with their notes, are in [history/](history/index.md).\n"]
    results = load_results(root)
    if not results:
        out.append("No bench has stored a result yet (`bench/results/<bench>/result.json`).\n")
    for r in results:
        out += _bench_section(r, "../")
    gpu = gpu_files(root / GPU_CHECK)
    if gpu:
        out += _gpu_section(gpu, "../")
    return "\n".join(out).rstrip() + "\n"


# ---- the README's table ----------------------------------------------------------------------
def readme_table(root: Path = RESULTS) -> str:
    rows = ["| bench | headline (stored result) | plots |", "| --- | --- | --- |"]
    for r in load_results(root):
        plots = ", ".join(f"[{p}]({r['folder']}/{p})" for p in r["plots"]) or "-"
        rows.append(f"| [{r['bench']}]({r['folder']}/result.json) | {figures(r['result'], README_FIGURES)} | {plots} |")
    gpu = gpu_files(root / GPU_CHECK)
    if gpu:
        picked = "; ".join(f"{k} {value(v)}" for k, v in _pick(gpu, GPU_README))
        rows.append(f"| [gpu-check (one H200)](bench/results/{GPU_CHECK}/README.md) | {picked} | - |")
    return "\n".join(rows)


def with_readme_table(readme: str, root: Path = RESULTS) -> str:
    """The README with the text between the BENCHMARKS markers replaced by the table."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers")
    return readme[:start + len(BEGIN)] + "\n" + readme_table(root) + "\n" + readme[end:]
