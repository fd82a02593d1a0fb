"""Per-expert call statistics for `peerd status`: counts, tokens, mean and p99 latency, errors."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from peerd.metrics import EXPERT_CALL_BUCKETS, Distribution

__all__ = ["CallStats", "latency_histogram", "merged", "status_section"]

WINDOW = 1000  # latencies kept for the percentiles


@dataclass
class CallStats:
    calls: int = 0
    tokens: int = 0
    errors: int = 0
    timeouts: int = 0
    late: int = 0  # caller side: abandoned after the layer's grace period (neither answered nor failed)
    activations_gone: int = 0  # caller side: backward calls repeated with the inputs (host dropped them)
    out_of_bound: int = 0  # caller side: answers over moe.max_answer_ratio times the typical host's
    last_error: str | None = None
    histogram: Distribution | None = None  # shared by a server's or client's experts, for /metrics
    _latencies: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def ok(self, tokens: int, seconds: float) -> None:
        self.calls += 1
        self.tokens += tokens
        self._latencies.append(seconds)
        if self.histogram is not None:
            self.histogram.observe(seconds)

    def failed(self, reason: str, timed_out: bool = False) -> None:
        self.calls += 1
        self.errors += 1
        self.timeouts += int(timed_out)
        self.last_error = reason[:300]

    def as_dict(self) -> dict[str, Any]:
        latencies = sorted(self._latencies)
        mean = sum(latencies) / len(latencies) if latencies else None
        p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)] if latencies else None
        return {
            "calls": self.calls,
            "tokens": self.tokens,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "late": self.late,
            "activations_gone": self.activations_gone,
            "out_of_bound": self.out_of_bound,
            "mean_ms": None if mean is None else round(mean * 1e3, 3),
            "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            "last_error": self.last_error,
        }


def latency_histogram() -> Distribution:
    return Distribution(EXPERT_CALL_BUCKETS)


def merged(histograms: list[Distribution]) -> dict[str, Any]:
    """One ``Distribution.as_dict()`` summing histograms of the same buckets."""
    total = latency_histogram()
    for histogram in histograms:
        total.counts = [a + b for a, b in zip(total.counts, histogram.counts, strict=True)]
        total.total += histogram.total
    return total.as_dict()


def status_section(server: Any, client: Any) -> dict[str, Any]:
    """The daemon status' ``experts`` section from an ExpertServer and/or ExpertClient (either may be None).

    ``calls``, ``errors`` and ``latency`` (a ``Distribution.as_dict()``) sum both sides, for /metrics;
    ``server`` details this host's experts, ``client`` the experts this peer's model called.
    """
    calls = errors = 0
    histograms = []
    for side in (server, client):
        if side is not None:
            side_calls, side_errors = side.totals()
            calls, errors = calls + side_calls, errors + side_errors
            histograms.append(side.latency)
    called = client.status() if client is not None else None
    return {
        "calls": calls,
        "errors": errors,
        "latency": merged(histograms),
        "server": server.status() if server is not None else None,
        "client": called if called and (called["experts"] or called["layers"]) else None,
    }
