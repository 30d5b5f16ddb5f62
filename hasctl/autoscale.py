"""`hasctl up --autoscale MIN:MAX`: follow the online controller's desired instance counts
through the launcher.

Every encode instance runs `--online` with `--online-instances MIN:MAX` and
`--online-instances-file <run_dir>/instances.json` (the count per stage, which this thread keeps)
and exports `easerve:desired_instances{stage}`; every `poll_s` the `Autoscaler` thread reads it from the
encode instances' /metrics (the largest answer wins), and moves each stage it is exported for
one instance at a time towards it: `Stack.add_instance(stage)` (listed once SERVING) or
`Stack.remove_instance(name)` of the newest (unlisted, then drained: its open calls finish).
Each action is logged and kept in `actions`.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("hasctl.autoscale")
METRIC = "easerve:desired_instances"


def counts_file(run_dir) -> Path:
    return Path(run_dir) / "instances.json"


@dataclass(frozen=True)
class Action:
    at: float
    stage: str
    verb: str       # "add" | "remove"
    name: str
    desired: int


def desired_of(pages: list[str]) -> dict[str, int]:
    """stage -> the largest desired count any of the /metrics pages exports."""
    out: dict[str, int] = {}
    for text in pages:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == METRIC and "stage" in s.labels:
                    out[s.labels["stage"]] = max(out.get(s.labels["stage"], 0), int(s.value))
    return out


def parse_min_max(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
        raise ValueError(f"--autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(lo), int(hi)


class Autoscaler:
    def __init__(self, stack, bounds: tuple[int, int], poll_s: float = 2.0) -> None:
        self.stack, self.bounds, self.poll_s = stack, bounds, poll_s
        self.counts_file = counts_file(stack.run_dir)
        self.actions: list[Action] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Autoscaler":
        self.write_counts()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120.0)

    def instances(self, stage: str) -> list[str]:
        return [n for n in self.stack.endpoints.stages if n.rpartition("-")[0] == stage]

    def step(self) -> Action | None:
        """One look at the desired counts and at most one action towards them."""
        pages = []
        for name in self.instances("encode"):
            url = self.stack.endpoints.metrics.get(name)
            if url is None:
                continue
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                    pages.append(r.read().decode())
            except OSError:
                continue  # restarting or draining: the others answer
        lo, hi = self.bounds
        for stage, want in sorted(desired_of(pages).items()):
            want = min(max(want, lo), hi)
            have = self.instances(stage)
            if len(have) < want:
                name = self.stack.add_instance(stage)
                return self._did(stage, "add", name, want)
            if len(have) > want:
                name = have[-1]
                self.stack.remove_instance(name)
                return self._did(stage, "remove", name, want)
        return None

    def write_counts(self) -> None:
        """The instance count per stage, for the encode controllers (--online-instances-file)."""
        counts = {s: len(self.instances(s)) for s in ("encode", "prefill", "decode")}
        tmp = self.counts_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, self.counts_file)

    def _did(self, stage: str, verb: str, name: str, want: int) -> Action:
        self.write_counts()
        a = Action(time.monotonic(), stage, verb, name, want)
        self.actions.append(a)
        log.info("autoscale: %s %s (%s wants %d)", verb, name, stage, want)
        print(f"{time.strftime('%H:%M:%S')} autoscale: {verb} {name} ({stage} wants {want})", flush=True)
        return a

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed add/remove is logged; the next poll tries again
                log.exception("autoscale step failed")
