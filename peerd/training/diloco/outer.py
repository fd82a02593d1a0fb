"""DiLoCo's outer side: the shared parameters every member agrees on, the outer optimizer that moves them,
and the anchor each phase's pseudo-gradient is measured from.

A phase starts from the shared parameters theta. After it, this peer's pseudo-gradient is ``anchor - local``
(how far its inner steps moved it); the group averages them, and the outer optimizer (torch's SGD with
Nesterov momentum, on one flat tensor) moves theta by the average. Every member of the round gets the same
bit-identical average and holds the same theta and momentum, so all of them end on the same theta.

At the end of a phase the anchor becomes where the phase ended (x). With overlap the next phase starts from
there at once; when the average lands, :meth:`OuterState.fold` moves both the local parameters and the anchor
by ``theta - x``. The local progress made in the meantime is kept (as in streaming/eager-update DiLoCo) and
counts in the next pseudo-gradient, measured from the moved anchor. Without overlap the fold comes before
any inner step, so the local parameters simply become theta.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from peerd.config.diloco import DilocoConfig
from peerd.training.device import flat_views, host_buffer
from peerd.training.local import LocalModel

SHARED, MOMENTUM = "outer/shared", "outer/momentum"


class OuterUpdate(NamedTuple):
    """An outer step computed beside the state it moves: the state's next shared parameters and momentum, and
    the generation of the state they were computed from (a state loaded meanwhile makes them stale)."""

    shared: torch.Tensor
    momentum: torch.Tensor | None
    generation: int


class OuterState:
    def __init__(self, config: DilocoConfig, local: LocalModel) -> None:
        self.local = local
        device = local.device
        with torch.no_grad():
            self.shared = torch.cat([p.detach().reshape(-1) for p in local.params]).to(device)
        self.anchor = self.shared.clone()
        self.config = config
        # created now so a state has the same tensors before and after round 1
        self.momentum = torch.zeros_like(self.shared) if config.outer_momentum > 0 else None
        self.pseudo = host_buffer(local.numel, device)  # what this peer sends
        self.averaged = host_buffer(local.numel, device)  # what the group sends back
        self._generation = 0  # moves on whenever the shared state changes (see OuterUpdate)

    def end_phase(self) -> torch.Tensor:
        """The phase's pseudo-gradient ``anchor - local``, in the reused CPU buffer; the anchor moves to the
        local parameters, where the next phase starts (at once with overlap, else after :meth:`step`)."""
        params = self.local.params
        with torch.no_grad():
            for (p, anchor), (_, out) in zip(flat_views(params, self.anchor), flat_views(params, self.pseudo),
                                             strict=True):
                out.copy_(anchor - p)
                anchor.copy_(p)
        return self.pseudo

    def step(self, averaged: torch.Tensor) -> str | None:
        """Moves the shared parameters by the group's average pseudo-gradient, then folds; None if done, else
        why not (a non-finite average or result is refused: theta, momentum and the model stay as they were)."""
        update = self.prepare(averaged)
        if isinstance(update, str):
            return update
        committed = self.commit(update)
        assert committed  # nothing changed the state in between
        return None

    def prepare(self, averaged: torch.Tensor) -> OuterUpdate | str:
        """The shared parameters and momentum after the outer step, in new tensors (this state unchanged), or
        why there are none. It reads only the shared state, which the inner steps never touch: the trainer
        runs it while the next phase computes, and holds its step lock only for :meth:`commit`."""
        if not bool(torch.isfinite(averaged).all()):
            return "the averaged pseudo-gradient holds NaN/Inf"
        shared = self.shared.clone()
        momentum = self.momentum.clone() if self.momentum is not None else None
        optimizer = torch.optim.SGD([shared], lr=self.config.outer_lr, momentum=self.config.outer_momentum,
                                    nesterov=self.config.nesterov and self.config.outer_momentum > 0)
        if momentum is not None:
            optimizer.state[shared]["momentum_buffer"] = momentum
        shared.grad = self.local.to_device(averaged)
        optimizer.step()
        shared.grad = None
        if not bool(torch.isfinite(shared).all()) or (momentum is not None and not bool(torch.isfinite(momentum).all())):
            return "the outer step would have made the shared parameters non-finite; not applied"
        return OuterUpdate(shared, momentum, self._generation)

    def commit(self, update: OuterUpdate) -> bool:
        """Makes a prepared update the shared state and folds it into the model; False (nothing done) if the
        shared state changed since it was prepared from it (a state loaded meanwhile): prepare again."""
        if update.generation != self._generation:
            return False
        self.shared, self.momentum = update.shared, update.momentum
        self.fold()
        return True

    def fold(self) -> None:
        """Moves the local parameters and the anchor by ``shared - anchor``: the anchor becomes ``shared``."""
        with torch.no_grad():
            for p, (_, shared), (_, anchor) in zip(self.local.params, flat_views(self.local.params, self.shared),
                                                  flat_views(self.local.params, self.anchor), strict=True):
                # theta + (local - anchor), not local + (theta - anchor): without local progress since the
                # phase ended (no overlap, or the last phase) local == anchor bit for bit and lands exactly on
                # theta, so every member holds bit-identical weights, not theta up to its own rounding
                p.copy_(shared + (p - anchor))
            self.anchor.copy_(self.shared)
        self._generation += 1

    def reset_to_local(self) -> None:
        """After a state was loaded into the model: the shared parameters and the anchor are the model's."""
        with torch.no_grad():
            for p, part in flat_views(self.local.params, self.shared):
                part.copy_(p.detach())
            self.anchor.copy_(self.shared)
        self._generation += 1

    def flat(self) -> torch.Tensor:
        """Shared parameters then momentum, on the CPU: what diloco's state averaging averages."""
        parts = [self.shared] + ([self.momentum] if self.momentum is not None else [])
        return torch.cat(parts).cpu()

    def load_flat(self, flat: torch.Tensor) -> None:
        """Loads :meth:`flat`'s layout and folds: the local parameters move with the shared ones."""
        parts = [self.shared] + ([self.momentum] if self.momentum is not None else [])
        with torch.no_grad():
            for t, part in flat_views(parts, flat):
                t.copy_(part)
        self.fold()

    def flat_numel(self) -> int:
        return self.shared.numel() * (2 if self.momentum is not None else 1)

    def adopt(self, flat: torch.Tensor) -> None:
        """Loads :meth:`flat`'s layout as the shared state and makes it the model and the anchor: the next
        phase starts from the group's theta."""
        parts = [self.shared] + ([self.momentum] if self.momentum is not None else [])
        with torch.no_grad():
            for t, part in flat_views(parts, flat):
                t.copy_(part)
            for p, part in flat_views(self.local.params, self.shared):
                p.copy_(part)
            self.anchor.copy_(self.shared)
        self._generation += 1

    def load_named(self, tensors: dict[str, torch.Tensor]) -> None:
        """Loads :meth:`named`'s tensors from a checked state; the next phase is measured from theta."""
        with torch.no_grad():
            for name, live in self.named().items():
                live.copy_(tensors[name])
            self.anchor.copy_(self.shared)
        self._generation += 1

    def named(self) -> dict[str, torch.Tensor]:
        tensors = {SHARED: self.shared}
        if self.momentum is not None:
            tensors[MOMENTUM] = self.momentum
        return tensors
