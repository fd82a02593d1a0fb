"""How large one peer's tensors may be against the other peers': a bound set by a median in which each peer has
one vote. Both sides of a remote expert use it, on what the other side sends.

**The host, against its callers.** Every member may call a served expert's backward pass, and each backward batch
becomes one optimizer step. The step's gradient is clipped as a whole (``experts.max_grad_norm``), so a caller
that sends output gradients a thousand times everyone else's would set the step's direction alone, clip or no
clip. Each caller's output gradients are scaled down to at most ``experts.max_caller_gradient_ratio`` times the
typical caller's before they enter the batch.

**The caller, against the hosts.** A host answers with any finite tensor of the right shape; one answering a
thousand times what an expert computes would swamp the tokens routed to it, and the gradients of the whole model
behind them. A MoE layer bounds each host's answers (forward outputs, and input gradients apart) at
``moe.max_answer_ratio`` times the typical host's (:mod:`peerd.experts.client.layer`).

A tensor's size is its L2 norm over the square root of its rows (tokens). The typical peer's is the lower median,
over the peers heard from recently, of each peer's median over its recent tensors: a peer has one vote however
often it sends, and one that sends larger tensors than every other peer never sets it. With two peers, the smaller
one sets it: a peer sending tiny tensors can then shrink the other's, but neither steers alone. The bound limits
size, not direction: a tensor of typical size pointing anywhere passes.
"""

from __future__ import annotations

import math
import threading

import torch

from peerd.bounded import PeerMedians

__all__ = ["NormBound", "per_token_norm"]

CALLS_KEPT = 16  # of each peer: its median follows what it sends now, not what it sent an hour ago
PEERS_KEPT = 256  # the peers heard from last; older ones are forgotten first


def per_token_norm(tensor: torch.Tensor) -> float:
    """The tensor's L2 norm over the square root of its rows (a call's tokens)."""
    return float(torch.linalg.vector_norm(tensor)) / math.sqrt(max(1, tensor.shape[0]))


class NormBound:
    def __init__(self, ratio: float | None) -> None:
        """``ratio``: how many times the typical peer's per-token norm one tensor may reach (None: no bound)."""
        self.ratio = ratio
        self.scaled = 0  # tensors :meth:`bound` scaled down (callers of :meth:`factor` count what they do)
        self._medians = PeerMedians(CALLS_KEPT, PEERS_KEPT)
        self._lock = threading.Lock()  # a host's compute threads serve several experts' queues at once

    def bound(self, peer: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` from ``peer``, scaled down if it exceeds the bound set by what the peers sent before it
        (itself otherwise). Its norm, as sent, counts in ``peer``'s median from now on."""
        norm = per_token_norm(tensor)
        with self._lock:
            reference = self._medians.typical()
            self._medians.observe(peer, norm)
            factor = self._factor(norm, reference)
            if factor != 1.0:
                self.scaled += 1
        return tensor if factor == 1.0 else tensor * factor

    def observe(self, peer: str, norm: float) -> None:
        """Counts a per-token norm ``peer`` sent in its median (a zero tensor teaches nothing: it never sets the
        reference)."""
        self._medians.observe(peer, norm)

    def factor(self, norm: float) -> float:
        """What a tensor of per-token norm ``norm`` is multiplied by under the bound as it stands (1: kept)."""
        with self._lock:
            return self._factor(norm, self._medians.typical())

    @property
    def voters(self) -> int:
        """Peers whose tensors count in the bound."""
        return len(self._medians)

    def heard(self, peer: str) -> bool:
        """Whether ``peer``'s tensors count in the bound."""
        return peer in self._medians

    def reference(self) -> float | None:
        """The typical peer's per-token norm (None before any peer sent one)."""
        return self._medians.typical()

    def _factor(self, norm: float, reference: float | None) -> float:
        if self.ratio is None or reference is None or norm <= self.ratio * reference:
            return 1.0
        return self.ratio * reference / norm
