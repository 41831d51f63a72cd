"""docs/metrics.md lists every series the server exports, with its labels: a metric added to
cronoq_server/metrics.py without its row (or with other labels) fails here."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import Counter
from prometheus_client.metrics import MetricWrapperBase

from cronoq_server import metrics

PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, set[str]]:
    """The page's table: metric name -> its labels."""
    rows = re.findall(r"^\| `(cronoq_\w+)` \|\s*([^|]*?)\s*\|", PAGE.read_text(), flags=re.M)
    return {name: {label.strip() for label in labels.split(",") if label.strip()} for name, labels in rows}


def exported() -> dict[str, set[str]]:
    series = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            name = metric._name + ("_total" if isinstance(metric, Counter) else "")
            series[name] = set(metric._labelnames)
    return series


def test_every_metric_is_documented_with_its_labels() -> None:
    assert len(exported()) > 20
    assert exported() == documented()
