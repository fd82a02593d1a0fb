"""The pieces metric families are made of: :class:`Distribution`, the one thing components record into (a
fixed-bucket histogram kept in their own reports), and builders that turn values read from a status snapshot
into Prometheus families, leaving a family without samples where a value is missing (never a made-up zero)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = [
    "CONTENT_TYPE", "EXPERT_CALL_BUCKETS", "ROUND_DURATION_BUCKETS", "Distribution", "by_label", "counter", "gauge",
    "histogram", "mapping", "number",
]

ROUND_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
EXPERT_CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


@dataclass
class Distribution:
    """Counts of observed values per bucket (upper bounds inclusive, one overflow bucket) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return  # a NaN would poison the sum forever
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def as_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


def histogram(name: str, doc: str, data: Any, bounds: Sequence[float]) -> HistogramMetricFamily:
    """Cumulative Prometheus buckets from a ``Distribution.as_dict()``; empty buckets when there is none."""
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    if isinstance(data, Mapping) and list(data.get("bounds", ())) == list(bounds):
        raw = data.get("counts")
        if isinstance(raw, list) and len(raw) == len(counts) and all(isinstance(c, int) for c in raw):
            counts, total = raw, float(data.get("sum") or 0.0)
    buckets, running = [], 0
    for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        running += count
        buckets.append((bound, float(running)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


def mapping(data: Mapping[str, Any] | None, key: str) -> Mapping[str, Any] | None:
    value = data.get(key) if data is not None else None
    return value if isinstance(value, Mapping) else None


def number(data: Mapping[str, Any] | None, key: str) -> float | None:
    value = data.get(key) if data is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def by_label(family: Family, counts: Mapping[str, Any] | None) -> Family:
    """``family`` (one label) with a sample per numeric entry of ``counts`` (label value -> number)."""
    for label in counts or {}:
        if (value := number(counts, label)) is not None:
            family.add_metric([str(label)], value)
    return family


def counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family
