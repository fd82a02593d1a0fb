"""``RemoteMoE``: a mixture-of-experts layer whose experts run on other peers.

Forward: the router scores the experts that are routable (announced in the DHT, right width, not backing
off), each token picks its top ``k``; then **one call per expert** carries every token routed to it (never one
per token or sample), all experts concurrently. The layer proceeds once ``k_min`` experts answered for every
token and ``grace`` seconds passed (or all answered, or ``timeout`` expired), and mixes the answers with the
gate weights renormalized over the experts that answered. Backward: one call per expert that answered,
carrying its tokens' output gradients (and the inputs too if the host did not keep the forward activations,
see :mod:`peerd.experts.server.stash`); the host returns input gradients and updates the expert.

Fallback: a token no expert answered for (or every expert dead) gets a **zero** output, so in a residual
block it passes through unchanged; its router gets no gradient from it in that pass.

Answers are bounded (:mod:`peerd.experts.bounds`), forward outputs and input gradients apart: a forward answer
over ``max_answer_ratio`` times the typical host's, per token, is left out like a failed call and its expert is
skipped for a while, or, while fewer than three hosts set the bound and this peer's own experts are not among
them, scaled down to it; input gradients over it are scaled down to it. A forward answer scaled
by ``f`` is a function scaled by ``f``, so its backward call carries the output gradients times ``f``.

The module's only parameters are the router's: the experts' parameters live on their hosts. It must run on a
worker thread (the trainer's), never on the daemon's event loop thread, which does the I/O.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Coroutine
from typing import Any

import torch
from torch import nn

from peerd.config import MoEConfig
from peerd.errors import ActivationsGone, PeerdError
from peerd.experts.bounds import per_token_norm
from peerd.experts.calls import wire_codec
from peerd.experts.client.client import Answer, ExpertClient, LayerStats
from peerd.experts.client.dispatch import gather_quorum
from peerd.experts.client.router import Router, load_balancing_loss, renormalize, route
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire import codec

__all__ = ["RemoteMoE"]

# Seconds a pass waits, beyond its own timeout, for the loop to hand back the results.
_SLACK = 5.0
_QUORUM_SLACK = 0.25
_WARN_EVERY = 30.0  # seconds between warnings that a layer has no expert to call

logger = logging.getLogger(__name__)
_FIRST_REFRESH_TIMEOUT = 15.0
# Hosts whose answers set the bound before an answer over it is left out (below, unless this peer's own experts
# are among them: scaled down): the lower median of three hosts' is never one liar's.
_JURY = 3
_TINY = 1e-12  # what a call that sent zeros is measured against

Plan = list[tuple[int, torch.Tensor, torch.Tensor]]  # (expert, token indices, slot indices) per called expert
Kept = tuple[dict[int, int], dict[int, float]]  # per expert: the call id of its kept activations, its answer's scale


class RemoteMoE(nn.Module):
    """Maps ``[..., hidden_dim]`` to ``[..., hidden_dim]``; ``last_aux_loss`` holds the load-balancing loss
    of the latest forward pass (add ``config.aux_loss_weight * last_aux_loss`` to the training loss)."""

    def __init__(
        self,
        hidden_dim: int,
        uids: list[str],
        config: MoEConfig,
        client: ExpertClient | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.uids = list(uids)
        self.config = config
        self.name = name or (self.uids[0].rsplit(".", 1)[0] if self.uids else "moe")
        self.router = Router(hidden_dim, len(self.uids))
        self.last_aux_loss: torch.Tensor = torch.zeros(())
        self._client: ExpertClient | None = None
        self.stats = LayerStats()
        self._warned_at = -math.inf
        self._dummy = torch.empty(0, requires_grad=True)  # makes backward run even if the input needs no grad
        if client is not None:
            self.attach(client)

    def attach(self, client: ExpertClient) -> None:
        """Connects the layer to the swarm's experts (models may be built before the daemon's P2P exists)."""
        self._client = client
        self.stats = client.track(self.name, self.config.refresh_period, self.config.retry_after)

    @property
    def client(self) -> ExpertClient:
        if self._client is None:
            raise PeerdError("this RemoteMoE layer is not attached to an ExpertClient (no swarm to call)")
        return self._client

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_dim:
            raise ValueError(f"expected inputs of width {self.hidden_dim}, got {tuple(x.shape)}")
        flat = x.reshape(-1, self.hidden_dim)
        client = self.client
        client.directory.wait_for_experts(_FIRST_REFRESH_TIMEOUT)
        reasons = client.directory.unroutable_reasons(self.uids, self.hidden_dim)
        alive = torch.tensor([reason is None for reason in reasons], dtype=torch.bool)
        self.stats.passes += 1
        self.stats.tokens += flat.shape[0]
        if not bool(alive.any()):
            if time.monotonic() - self._warned_at >= _WARN_EVERY:
                self._warned_at = time.monotonic()
                why = ", ".join(f"{uid}: {reason}" for uid, reason in zip(self.uids, reasons, strict=True))
                logger.warning(
                    "MoE layer %s: no expert can be called (%s); its output is zero", self.name, why
                )
            self.stats.no_expert_alive += 1
            self.stats.fallback_tokens += flat.shape[0]
            self.last_aux_loss = self.router.proj.weight.sum() * 0.0
            return torch.zeros_like(x)
        routing = route(self.router(flat), alive, self.config.k, self.config.noise if self.training else 0.0)
        # keep the hosts' activations only if a backward pass will follow (not under no_grad, e.g. validation)
        keep = torch.is_grad_enabled()
        outputs, answered = _RemoteExperts.apply(self._dummy, flat, routing.indices, self, keep)  # type: ignore[no-untyped-call]
        weights = renormalize(routing.gates, answered)
        self.last_aux_loss = load_balancing_loss(routing.probs, routing.indices, int(alive.sum()))
        answers = answered.sum(dim=-1)
        self.stats.fallback_tokens += int((answers == 0).sum())
        self.stats.partial_tokens += int(((answers > 0) & (answers < routing.indices.shape[1])).sum())
        mixed: torch.Tensor = (weights.unsqueeze(-1) * outputs).sum(dim=1)
        return mixed.reshape(x.shape)

    # --- the calls, run from _RemoteExperts on the calling (worker) thread ----------------------------------

    def _plan(self, indices: torch.Tensor, mask: torch.Tensor | None = None) -> Plan:
        """(expert, token indices, slot indices) for every expert with at least one token."""
        plan = []
        for expert in torch.unique(indices).tolist():
            selected = indices == expert if mask is None else (indices == expert) & mask
            tokens, slots = selected.nonzero(as_tuple=True)
            if tokens.numel():
                plan.append((int(expert), tokens, slots))
        return plan

    def _call_all(
        self, calls: list[Coroutine[Any, Any, Answer]], plan: Plan, num_tokens: int
    ) -> dict[int, Answer]:
        need = torch.zeros(num_tokens, dtype=torch.long)
        for _, tokens, _ in plan:
            need[tokens] += 1
        need.clamp_(max=self.config.k_min)
        # the calls time out on their own first (and are counted as failures); the quorum's deadline is a backstop
        deadline = self.config.timeout + _QUORUM_SLACK
        quorum = gather_quorum(calls, [tokens for _, tokens, _ in plan], need, deadline, self.config.grace)
        return self.client.run(quorum, deadline + _SLACK)

    def _bound(
        self, results: dict[int, Answer], sent: list[torch.Tensor], plan: Plan, phase: pb.ExpertPhase
    ) -> dict[int, float]:
        """The factor each answer is multiplied by. What is bounded is an answer's gain: its per-token norm over
        that of what the call sent (inputs, or output gradients), so that neither the tokens nor their gate
        weights, which scale the output gradients, make an honest answer look large. 1 within the bound (and for
        this peer's own experts). A forward answer over it: 0, the answer left out and its expert skipped, once
        at least ``_JURY`` hosts' answers set the bound, or this peer's own experts' are among them (the one
        other host, if it set the bound low, is the only one it can be over); with fewer, the factor that scales
        it down to the bound, since either of two other hosts may be a liar that set it low. Input gradients
        over it are always scaled down: they vary more between honest experts than outputs do (an honest one
        reached 4.2 times the typical host's). Every answer of the pass counts in its host's median first, so
        the answers of the first pass already bound each other."""
        outputs_bound, gradients_bound = self.client.answer_bounds(self.name, self.config.max_answer_ratio)
        bound = outputs_bound if phase == pb.EXPERT_FORWARD else gradients_bound
        norms = {i: per_token_norm(answer.result) / max(per_token_norm(sent[i]), _TINY) for i, answer in results.items()}
        for i, answer in results.items():
            bound.observe(answer.host, norms[i])
        me, factors = self.client.swarm.peer_id, {}
        for i, answer in results.items():
            uid = self.uids[plan[i][0]]
            factors[i] = 1.0 if answer.host == me else bound.factor(norms[i])
            if factors[i] == 1.0:
                self.client.within_bound(uid)
                continue
            why = None
            if phase == pb.EXPERT_FORWARD and (bound.voters >= _JURY or bound.heard(me)):
                why = f"gain {norms[i]:.3g}, over {bound.ratio}x the typical host's {bound.reference():.3g}"
                factors[i] = 0.0
            self.client.out_of_bound(uid, phase, answer.host, why)
        return factors

    def _call(
        self, expert: int, phase: pb.ExpertPhase, parts: list[torch.Tensor], call_id: int = 0
    ) -> Coroutine[Any, Any, Answer]:
        lossless = self.config.wire == "raw"
        try:
            payloads = [codec.encode(t, wire_codec(lossless)) for t in parts]
        except ValueError as e:  # NaN/Inf activations: never sent; these tokens fall back for this expert
            return _refused(f"not calling expert {self.uids[expert]}: {e}")
        uid, tokens = self.uids[expert], parts[0].shape[0]
        return self.client.call(
            uid, phase, payloads, tokens, self.hidden_dim, lossless, self.config.timeout, call_id
        )

    def remote_forward(
        self, flat: torch.Tensor, indices: torch.Tensor, keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Kept]:
        """Outputs [T, k, d], which answered [T, k], and per expert: the call id of the activations its host
        keeps, and its answer's scale."""
        plan = self._plan(indices)
        ids = [secrets.randbits(63) | 1 if keep else 0 for _ in plan]  # nonzero: keep the activations
        sent = [flat[tokens] for _, tokens, _ in plan]
        calls = [
            self._call(expert, pb.EXPERT_FORWARD, [inputs], call_id)
            for (expert, _, _), inputs, call_id in zip(plan, sent, ids, strict=True)
        ]
        results = self._call_all(calls, plan, flat.shape[0])
        factors = self._bound(results, sent, plan, pb.EXPERT_FORWARD)
        outputs = flat.new_zeros(*indices.shape, self.hidden_dim)
        answered = torch.zeros(indices.shape, dtype=torch.bool)
        kept: dict[int, int] = {}
        scales: dict[int, float] = {}
        for i, (expert, tokens, slots) in enumerate(plan):
            if factors.get(i, 0.0) > 0.0:
                outputs[tokens, slots] = results[i].result * factors[i]
                answered[tokens, slots] = True
                scales[expert] = factors[i]
                if results[i].kept:
                    kept[expert] = ids[i]
        return outputs, answered, (kept, scales)

    def remote_backward(
        self,
        flat: torch.Tensor,
        indices: torch.Tensor,
        answered: torch.Tensor,
        grad_outputs: torch.Tensor,
        kept: Kept,
    ) -> torch.Tensor:
        # an expert that answered the forward call answered for all its tokens: same tokens, same order
        plan = self._plan(indices, answered)
        ids, scales = kept
        sent = [grad_outputs[tokens, slots] * scales.get(expert, 1.0) for expert, tokens, slots in plan]
        calls = [
            self._backward_call(expert, flat[tokens], grads, ids.get(expert, 0))
            for (expert, tokens, _), grads in zip(plan, sent, strict=True)
        ]
        results = self._call_all(calls, plan, flat.shape[0])
        factors = self._bound(results, sent, plan, pb.EXPERT_BACKWARD)
        grad_inputs = torch.zeros_like(flat)
        for i, (_, tokens, _) in enumerate(plan):
            if factors.get(i, 0.0) > 0.0:
                grad_inputs.index_add_(0, tokens, results[i].result * factors[i])
        return grad_inputs

    async def _backward_call(
        self, expert: int, inputs: torch.Tensor, grads: torch.Tensor, call_id: int
    ) -> Answer:
        if call_id:
            try:  # the host kept this call's activations: send only the output gradients
                return await self._call(expert, pb.EXPERT_BACKWARD, [grads], call_id)
            except ActivationsGone:
                pass  # dropped on the host (budget or age): send the inputs as well
        return await self._call(expert, pb.EXPERT_BACKWARD, [inputs, grads])

    def extra_repr(self) -> str:
        return (
            f"hidden_dim={self.hidden_dim}, experts={len(self.uids)}, k={self.config.k}, name={self.name!r}"
        )


async def _refused(reason: str) -> Answer:
    raise PeerdError(reason)


class _RemoteExperts(torch.autograd.Function):
    """Outputs [T, k, d] of the chosen experts and which of them answered [T, k] (not differentiable)."""

    @staticmethod
    def forward(
        ctx: Any, dummy: torch.Tensor, flat: torch.Tensor, indices: torch.Tensor, layer: RemoteMoE, keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = flat.detach()
        outputs, answered, kept = layer.remote_forward(flat, indices, keep)
        ctx.layer = layer
        ctx.kept = kept
        ctx.save_for_backward(flat, indices, answered)
        ctx.mark_non_differentiable(answered)
        return outputs, answered

    @staticmethod
    def backward(
        ctx: Any, grad_outputs: torch.Tensor, _: Any
    ) -> tuple[None, torch.Tensor | None, None, None, None]:
        flat, indices, answered = ctx.saved_tensors
        grad_inputs = ctx.layer.remote_backward(flat, indices, answered, grad_outputs.contiguous(), ctx.kept)
        return None, grad_inputs if ctx.needs_input_grad[1] else None, None, None, None
