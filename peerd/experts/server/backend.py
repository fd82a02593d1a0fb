"""One served expert: its module, its optimizer, and the batched forward/backward computations.

Everything here runs on the server's compute threads, never on the event loop. A backward batch goes
through the forward graphs the host kept for its calls (:mod:`peerd.experts.server.stash`) or, where none is kept
or the parameters changed since, recomputes the forward pass on the inputs; it sums the parameter gradients
of every call in the batch, answers the callers, and then applies one optimizer step (background work: see
:mod:`peerd.experts.server.workers`). Non-finite outputs or gradients raise
:class:`ExpertFailure` before any parameter changes, so a bad batch never corrupts the expert.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from peerd.config import ExpertsConfig
from peerd.experts.server.stash import Graph
from peerd.experts.stats import CallStats
from peerd.wire.codec import all_finite

__all__ = ["MAX_PENDING_STEPS", "BackwardItem", "ExpertBackend", "ExpertFailure"]

# Optimizer steps an expert may owe before its next backward batch applies them first (bounds staleness).
MAX_PENDING_STEPS = 2


@dataclass(frozen=True)
class BackwardItem:
    """One caller's share of a backward batch."""

    inputs: torch.Tensor
    grad_outputs: torch.Tensor
    graph: Graph | None = None  # the kept forward graph, if the host kept one for this call


class ExpertFailure(Exception):
    """The expert itself failed on a batch (non-finite output or gradient, or an error in its module)."""


def _optimizer(config: ExpertsConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    # The fused kernels update all parameters in a few passes instead of a loop of small ops per tensor, and the
    # step runs after every backward call.
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)


class ExpertBackend:
    def __init__(self, uid: str, module: nn.Module, config: ExpertsConfig) -> None:
        self.uid = uid
        self.module = module
        self.hidden_dim = config.hidden_dim
        self.max_grad_norm = config.max_grad_norm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = _optimizer(config, self.params)
        self.numel = sum(p.numel() for p in self.params)
        self.updates = 0
        self.skipped_updates = 0
        self.batches = {"forward": 0, "backward": 0}
        self.batched_tokens = {"forward": 0, "backward": 0}
        self.stats = {"forward": CallStats(), "backward": CallStats()}
        self.reused_graphs = 0  # backward calls served from a kept forward graph
        self.recomputed = 0  # backward calls whose forward pass was computed again
        # a copy of the initial parameters, so `peerd status` can show how far the expert has moved (learned)
        self._initial = [p.detach().clone() for p in self.params]
        # A forward batch must not see parameters half-way through an optimizer step.
        self._lock = threading.Lock()
        self._pending: deque[list[torch.Tensor | None]] = deque()  # gradients of answered backward batches

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with self._lock, torch.no_grad():
            outputs = self._run(inputs)
        self._count("forward", inputs.shape[0])
        return outputs

    def forward_keeping_graph(self, inputs: torch.Tensor) -> tuple[torch.Tensor, Graph]:
        """The forward pass with autograd on, for a backward call that comes later. An optimizer step still
        owed is applied first: the graph is only usable while the parameters stay as they were, and the
        step would otherwise land between this forward and its backward (it also gives the caller the
        newest parameters)."""
        with self._lock:
            while self._pending:
                self._apply(self._pending.popleft())
            leaf = inputs.detach().requires_grad_(True)
            with torch.enable_grad():
                outputs = self._run(leaf)
            version = self.updates
        self._count("forward", inputs.shape[0])
        return outputs.detach(), Graph(leaf, outputs, version)

    def backward(
        self,
        items: list[BackwardItem],
        deliver: Callable[[list[torch.Tensor]], None],
        schedule_step: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """Passes the gradients w.r.t. each item's inputs to ``deliver``; then the optimizer step with the
        parameter gradients of all items runs through ``schedule_step`` (background work, after other callers'
        batches) or, without it, right here. Either way the callers get their answer without waiting for it.
        Items whose kept graph is still valid go backward through it; the others are recomputed as one batch."""
        with self._lock:
            usable = [item.graph is not None and item.graph.version == self.updates for item in items]
            again = [item for item, ok in zip(items, usable, strict=True) if not ok]
            self._clear_grads()
            roots: list[torch.Tensor] = []
            grads_out: list[torch.Tensor] = []
            x = None
            with torch.enable_grad():
                if again:
                    x = torch.cat([item.inputs for item in again]).detach().requires_grad_(True)
                    roots.append(self._run(x))
                    grads_out.append(torch.cat([item.grad_outputs for item in again]))
                for item, ok in zip(items, usable, strict=True):
                    if ok and item.graph is not None:
                        roots.append(item.graph.outputs)
                        grads_out.append(item.grad_outputs)
                torch.autograd.backward(roots, grads_out)
            results: list[torch.Tensor | None] = []
            offset = 0
            for item, ok in zip(items, usable, strict=True):
                if ok and item.graph is not None:
                    results.append(item.graph.leaf.grad)
                else:
                    rows = item.inputs.shape[0]
                    results.append(None if x is None or x.grad is None else x.grad[offset : offset + rows])
                    offset += rows
            grads = [p.grad for p in self.params]
            self._clear_grads()
            if any(r is None for r in results) or not all_finite([*results, *grads]):
                self.skipped_updates += 1
                raise ExpertFailure(f"expert {self.uid} produced non-finite gradients; update skipped")
            self._pending.append(grads)
            # applied after this batch's gradients exist: applying first would invalidate the kept graphs
            while len(self._pending) > MAX_PENDING_STEPS:  # background steps fell behind: catch up
                self._apply(self._pending.popleft())
        self.recomputed += len(again)
        self.reused_graphs += len(items) - len(again)
        self._count("backward", sum(item.inputs.shape[0] for item in items))
        deliver([r for r in results if r is not None])
        if schedule_step is None:
            self.apply_pending_step()
        else:
            schedule_step(self.apply_pending_step)

    def _clear_grads(self) -> None:
        # Optimizer.zero_grad wraps this loop in profiler and dynamo hooks that cost more than the loop itself
        for param in self.params:
            param.grad = None

    def _count(self, phase: str, tokens: int) -> None:
        self.batches[phase] += 1
        self.batched_tokens[phase] += tokens

    def apply_pending_step(self) -> None:
        """One optimizer step with the oldest gradients not applied yet (none left: nothing to do)."""
        with self._lock:
            if self._pending:
                self._apply(self._pending.popleft())

    def _apply(self, grads: list[torch.Tensor | None]) -> None:
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self._clear_grads()
        self.updates += 1

    def _run(self, inputs: torch.Tensor) -> torch.Tensor:
        try:
            outputs = self.module(inputs)
        except Exception as e:  # a custom module's bug must not take the server down
            raise ExpertFailure(f"expert {self.uid} raised {type(e).__name__}: {e}") from e
        if not isinstance(outputs, torch.Tensor) or outputs.shape != inputs.shape:
            raise ExpertFailure(f"expert {self.uid} returned a wrong shape")
        if not all_finite([outputs]):
            raise ExpertFailure(f"expert {self.uid} produced NaN/Inf outputs")
        return outputs

    def status(self) -> dict[str, Any]:
        # Read while a compute thread may be updating: the numbers are for people, a torn read is harmless.
        with torch.no_grad():
            norm = math.sqrt(sum(float(p.pow(2).sum()) for p in self.params))
            moved = math.sqrt(sum(float((p - p0).pow(2).sum()) for p, p0 in zip(self.params, self._initial)))
        batches = self.batches
        return {
            "parameters": self.numel,
            "updates": self.updates,
            "skipped_updates": self.skipped_updates,
            "pending_steps": len(self._pending),
            "backward_from_kept_graph": self.reused_graphs,
            "backward_recomputed": self.recomputed,
            "param_norm": round(norm, 6),
            "distance_from_init": round(moved, 6),
            "forward": {
                **self.stats["forward"].as_dict(),
                "batches": batches["forward"],
                "mean_batch_tokens": round(self.batched_tokens["forward"] / max(1, batches["forward"]), 2),
            },
            "backward": {
                **self.stats["backward"].as_dict(),
                "batches": batches["backward"],
                "mean_batch_tokens": round(self.batched_tokens["backward"] / max(1, batches["backward"]), 2),
            },
        }
