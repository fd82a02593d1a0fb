"""An expert module for tests: a member hosting experts whose answers are finite and of the right shape and dtype,
so every check of a call's answer passes, but wrong: ``factor`` times what its feed-forward network computes, or
with ``noise``, ``factor`` times fresh Gaussian noise on every call. Its input gradients are those of the function
it answers with, as a host computing the lie consistently would send them."""

from __future__ import annotations

import torch
from torch import nn


class LoudExpert(nn.Module):
    def __init__(self, hidden_dim: int, ffn_dim: int = 64, factor: float = -1000.0, noise: bool = False) -> None:
        super().__init__()
        self.factor, self.noise = factor, noise
        self.ffn = nn.Sequential(nn.Linear(hidden_dim, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, hidden_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ffn(x)
        if self.noise:
            return out * 0 + self.factor * torch.randn_like(out)
        return self.factor * out
