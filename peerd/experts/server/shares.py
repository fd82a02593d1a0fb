"""How much of an expert's update one caller can make: its output gradients are bounded against the other callers'.

Every member of a swarm may call a served expert's backward pass, and each backward batch becomes one optimizer
step. The step's gradient is clipped as a whole (``experts.max_grad_norm``), so a caller that sends output
gradients a thousand times everyone else's would set the step's direction alone, clip or no clip. Each caller's
output gradients are therefore measured per token (their L2 norm over the square root of the tokens) and scaled
down to at most ``experts.max_caller_gradient_ratio`` times the typical caller's before they enter the batch:
the lower median, over the callers heard from recently, of each caller's median of its recent calls. A caller
has one vote in that median however many calls it makes, and one that sends larger gradients than every other
caller never sets it. With two callers, the smaller one sets it: a caller sending tiny gradients can then slow
the other's updates down, but no caller can steer the expert alone. The input gradients a caller gets back are
those of its scaled output gradients.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque

import torch

from peerd.bounded import remember

__all__ = ["CallerGradients"]

CALLS_KEPT = 16  # of each caller: its median follows what it sends now, not what it sent an hour ago
CALLERS_KEPT = 256  # the callers heard from last; older ones are forgotten first


class CallerGradients:
    def __init__(self, ratio: float | None) -> None:
        """``ratio``: how many times the typical caller's per-token gradient norm one call may reach (None: no
        bound)."""
        self.ratio = ratio
        self.scaled = 0  # calls whose gradients were scaled down
        self._norms: OrderedDict[str, deque[float]] = OrderedDict()
        self._medians: dict[str, float] = {}  # of each caller's kept norms, updated when they change
        self._lock = threading.Lock()  # the server's compute threads serve several experts' queues at once

    def bound(self, peer: str, grad_outputs: torch.Tensor) -> torch.Tensor:
        """``grad_outputs`` of one call by ``peer``, scaled down if they exceed the bound (itself otherwise). The
        call's norm, as sent, counts in ``peer``'s median from now on."""
        tokens = max(1, grad_outputs.shape[0])
        norm = float(torch.linalg.vector_norm(grad_outputs)) / math.sqrt(tokens)
        with self._lock:
            reference = self._reference()
            if norm > 0 and math.isfinite(norm):  # a zero gradient teaches nothing: it never sets the reference
                kept = self._norms.pop(peer, None) or deque(maxlen=CALLS_KEPT)
                kept.append(norm)
                self._medians[peer] = statistics.median(kept)
                for forgotten, _ in remember(self._norms, peer, kept, CALLERS_KEPT):
                    self._medians.pop(forgotten, None)
            if self.ratio is None or reference is None or norm <= self.ratio * reference:
                return grad_outputs
            self.scaled += 1
        return grad_outputs * (self.ratio * reference / norm)

    def reference(self) -> float | None:
        """The typical caller's per-token gradient norm (None before any caller sent one)."""
        with self._lock:
            return self._reference()

    def _reference(self) -> float | None:
        medians = sorted(self._medians.values())
        return medians[(len(medians) - 1) // 2] if medians else None
