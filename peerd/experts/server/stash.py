"""Activations an expert host keeps between a caller's forward call and its backward call.

With them a backward call carries only the output gradients (half the bytes of sending the inputs again) and
the host runs the backward pass through the autograd graph of the forward it already computed instead of
recomputing it. Entries are keyed by (expert, caller peer id, call id), so a peer can only ever consume its
own; they are bounded in tokens (``experts.keep_activations_tokens``, oldest dropped first) and in time
(``experts.keep_activations_ttl``). A dropped entry costs nothing but speed: the host answers
EXPERT_ACTIVATIONS_GONE and the caller repeats the call with the inputs, as protocol version 1 always did.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ActivationStash", "Graph", "Kept"]

Key = tuple[str, str, int]  # expert uid, caller peer id, call id


@dataclass(frozen=True)
class Graph:
    """A forward pass computed with autograd on: the input leaf, the outputs, the expert's step count then."""

    leaf: torch.Tensor
    outputs: torch.Tensor
    version: int


@dataclass(frozen=True)
class Kept:
    inputs: torch.Tensor  # [tokens, hidden], detached: enough to recompute if the graph cannot be used
    graph: Graph | None  # only for a call computed on its own (not batched with other callers' calls)
    expires: float  # time.monotonic()

    @property
    def tokens(self) -> int:
        return int(self.inputs.shape[0])


class ActivationStash:
    """Thread-safe: compute threads put and take entries concurrently."""

    def __init__(self, max_tokens: int, ttl: float) -> None:
        self.max_tokens = max_tokens
        self.ttl = ttl
        self._entries: OrderedDict[Key, Kept] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.kept = 0  # entries stored
        self.used = 0  # entries taken by their backward call
        self.dropped = 0  # entries evicted (expired or pushed out) before their backward call

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def put(self, key: Key, inputs: torch.Tensor, graph: Graph | None) -> bool:
        """Keeps a call's activations; False if they alone exceed the budget (nothing kept)."""
        kept = Kept(inputs.detach(), graph, time.monotonic() + self.ttl)
        if kept.tokens > self.max_tokens:
            return False
        with self._lock:
            self._expire(time.monotonic())
            old = self._entries.pop(key, None)
            if old is not None:  # the caller reused an id: the newer forward is the one its backward means
                self._tokens -= old.tokens
            while self._entries and self._tokens + kept.tokens > self.max_tokens:
                self._drop_oldest()
            self._entries[key] = kept
            self._tokens += kept.tokens
            self.kept += 1
        return True

    def take(self, key: Key) -> Kept | None:
        """Removes and returns the entry (None if it was never kept, was dropped or expired)."""
        with self._lock:
            kept = self._entries.pop(key, None)
            if kept is None:
                return None
            self._tokens -= kept.tokens
            if kept.expires < time.monotonic():
                self.dropped += 1
                return None
            self.used += 1
            return kept

    def _expire(self, now: float) -> None:
        while self._entries and next(iter(self._entries.values())).expires < now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, kept = self._entries.popitem(last=False)
        self._tokens -= kept.tokens
        self.dropped += 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._expire(time.monotonic())
            return {
                "max_tokens": self.max_tokens,
                "tokens": self._tokens,
                "calls": len(self._entries),
                "kept": self.kept,
                "used": self.used,
                "dropped": self.dropped,
            }
