"""Per-expert call statistics for `peerd status`: counts, tokens, mean and p99 latency, errors."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallStats"]

WINDOW = 1000  # latencies kept for the percentiles


@dataclass
class CallStats:
    calls: int = 0
    tokens: int = 0
    errors: int = 0
    timeouts: int = 0
    last_error: str | None = None
    _latencies: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def ok(self, tokens: int, seconds: float) -> None:
        self.calls += 1
        self.tokens += tokens
        self._latencies.append(seconds)

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
            "mean_ms": None if mean is None else round(mean * 1e3, 3),
            "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            "last_error": self.last_error,
        }
