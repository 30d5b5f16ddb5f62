"""Reading a /metrics page in tests with prometheus_client's own parser (no line splitting)."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (as exposed: `..._total`, `..._count`, `..._sum`)
    whose labels include `labels`; 0 when there is none."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())
