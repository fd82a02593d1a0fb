"""What a trainer reports to logs, `peerd status` and metrics: a plain, read-only-by-convention snapshot."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from peerd.averaging.allreduce import RoundReport

LOSS_HISTORY = 2000


@dataclass
class TrainingReport:
    fingerprint: str
    parameters: int
    state: str = "starting"
    step: int = 0
    loss: float | None = None  # exponential moving average of micro-batch losses
    validation_loss: float | None = None
    validation_step: int | None = None
    samples_per_second: float = 0.0
    swarm_samples_per_second: float = 0.0
    peers_training: int = 0
    rounds_ok: int = 0
    rounds_solo: int = 0
    state_syncs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_round: dict[str, Any] | None = None
    foreign_peers: dict[str, str] = field(default_factory=dict)
    losses: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=LOSS_HISTORY))
    _window: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=50))

    def record_loss(self, loss: float, samples: int, seconds: float) -> None:
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        self.losses.append((time.time(), self.step, loss))
        self._window.append((seconds, samples))
        busy = sum(s for s, _ in self._window)
        self.samples_per_second = sum(n for _, n in self._window) / busy if busy > 0 else 0.0

    def record_round(self, report: RoundReport) -> None:
        self.rounds_ok += 1
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.last_round = {
            "step": self.step,
            "group_size": report.group_size,
            "duration": round(report.duration, 3),
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "codec_error": report.codec_error,
            "excluded": dict(report.excluded),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "parameters": self.parameters,
            "state": self.state,
            "step": self.step,
            "loss": self.loss,
            "validation_loss": self.validation_loss,
            "validation_step": self.validation_step,
            "samples_per_second": round(self.samples_per_second, 2),
            "swarm_samples_per_second": round(self.swarm_samples_per_second, 2),
            "peers_training": self.peers_training,
            "rounds_ok": self.rounds_ok,
            "rounds_solo": self.rounds_solo,
            "state_syncs": self.state_syncs,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_round": self.last_round,
            "foreign_peers": self.foreign_peers,
        }
