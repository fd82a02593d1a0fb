"""Gating for a mixture of experts: softmax over the live experts' scores, top-k, renormalization, and the
standard auxiliary load-balancing loss. Pure torch, no I/O.

For tokens ``t`` (T of them), live experts ``E_alive`` and top-``k`` routing:

* ``p[t, i] = softmax(logits[t] + noise)[i]`` over live experts only (dead ones get probability 0);
* the token goes to the ``k`` experts of highest ``p[t]`` (``k`` capped at the number of live experts);
* its gate weights are those probabilities renormalized over the experts that *answered*, so they sum to 1;
  a token no chosen expert answered for gets all-zero weights (a zero output);
* load-balancing loss (Switch Transformer, eq. 4, with top-k dispatch):
  ``aux = |E_alive| * sum_i f_i * P_i`` where ``f_i`` is the fraction of the ``T * k`` token-slots sent to
  expert ``i`` and ``P_i`` the mean of ``p[:, i]`` over the tokens. It is 1 when routing is uniform and grows
  as tokens pile onto few experts; gradients reach the router through ``P``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Router", "Routing", "load_balancing_loss", "renormalize", "route"]


@dataclass(frozen=True)
class Routing:
    indices: torch.Tensor  # [T, k] int64 expert indices, best first
    gates: torch.Tensor  # [T, k] probabilities of those experts (differentiable)
    probs: torch.Tensor  # [T, E] full routing probabilities (0 for dead experts)


def route(logits: torch.Tensor, alive: torch.Tensor, k: int, noise: float = 0.0) -> Routing:
    """Top-``k`` routing of ``logits`` [T, E] among experts where ``alive`` [E] (bool) holds.

    ``noise`` > 0 adds Gaussian noise of that std to the logits first (exploration while training).
    """
    if logits.dim() != 2 or alive.shape != (logits.shape[1],):
        raise ValueError(
            f"logits must be [T, E] and alive [E], got {tuple(logits.shape)} and {tuple(alive.shape)}"
        )
    num_alive = int(alive.sum())
    if num_alive == 0:
        raise ValueError("no expert is alive")
    if noise > 0:
        logits = logits + noise * torch.randn_like(logits)
    masked = logits.masked_fill(~alive, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    # top-k of the logits, not of the probabilities: a live expert whose probability underflowed to 0 must
    # still rank above every dead one
    indices = masked.topk(min(k, num_alive), dim=-1).indices
    gates = probs.gather(-1, indices)
    return Routing(indices=indices, gates=gates, probs=probs)


def renormalize(gates: torch.Tensor, answered: torch.Tensor) -> torch.Tensor:
    """Gate weights over the experts that answered: each row sums to 1, or is all zero if none answered."""
    kept = gates * answered.to(gates.dtype)
    total = kept.sum(dim=-1, keepdim=True)
    return torch.where(
        total > 0, kept / total.clamp_min(torch.finfo(gates.dtype).tiny), torch.zeros_like(kept)
    )


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, num_alive: int) -> torch.Tensor:
    """``num_alive * sum_i f_i * P_i``; see the module docstring."""
    tokens, num_experts = probs.shape
    if tokens == 0:
        return probs.sum() * 0.0
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    counts.index_add_(
        0, indices.reshape(-1), torch.ones(indices.numel(), dtype=probs.dtype, device=probs.device)
    )
    fraction = counts / indices.numel()
    mean_prob = probs.mean(dim=0)
    return num_alive * (fraction * mean_prob).sum()


class Router(nn.Module):
    """A linear scoring layer: one logit per expert. Its parameters are local (averaged like any other)."""

    def __init__(self, hidden_dim: int, num_experts: int, std: float = 0.02) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_dim, num_experts, bias=False)
        nn.init.normal_(self.proj.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.proj(x)
        return logits
