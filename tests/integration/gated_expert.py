"""An expert module for tests: a feed-forward expert whose forward pass on a batch of exactly ``gate_tokens``
tokens waits until the file ``gate`` exists (and says so by creating ``gate``.held), so that a test can hold the
host's compute thread busy and fill its queues behind it, then let go."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

GATE_TIMEOUT = 60.0


class GatedExpert(nn.Module):
    def __init__(self, hidden_dim: int, gate: str, gate_tokens: int = 3) -> None:
        super().__init__()
        self.gate, self.gate_tokens = Path(gate), gate_tokens
        width = 2 * hidden_dim
        self.ffn = nn.Sequential(nn.Linear(hidden_dim, width), nn.GELU(), nn.Linear(width, hidden_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.gate_tokens:
            self.gate.with_suffix(".held").touch()
            deadline = time.monotonic() + GATE_TIMEOUT
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # a compute thread of the host, held on purpose
        out: torch.Tensor = self.ffn(x)
        return out
