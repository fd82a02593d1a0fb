"""This peer's side of the model: its optimizer, the flat buffers the all-reduce reads and writes, the
error-feedback residuals, and the optimizer step. No networking and no timing: the trainer decides when each of
these runs (all of them in worker threads, never on the event loop)."""

from __future__ import annotations

import torch

from peerd.config import TrainingConfig
from peerd.training.tasks import Batch, Task


def make_optimizer(config: TrainingConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)


class LocalModel:
    def __init__(self, config: TrainingConfig, task: Task, error_feedback: bool) -> None:
        """``error_feedback``: keep the residuals the all-reduce carries from one round into the next."""
        self.task = task
        self.model = task.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(config, self.model)
        self.numel = sum(p.numel() for p in self.params)
        self.residual = torch.zeros(self.numel) if error_feedback else None
        self.average_residual = torch.zeros(self.numel) if error_feedback else None
        # Reused every step: a fresh model-sized tensor per step would pay a page fault per 4 KiB each time.
        self._gradient = torch.empty(self.numel)
        self.averaged = torch.empty(self.numel)  # the all-reduce's `out`
        self._before_step = torch.empty(self.numel)  # the parameters before the last step, to undo it

    def forward_backward(self, batch: Batch) -> tuple[float, int]:
        samples = self.task.samples_in(batch)
        loss = self.task.loss(self.model, batch)
        # Gradients accumulate as sums over samples; flat_mean_grad divides by the sample count.
        torch.autograd.backward(loss * samples)
        return float(loss.detach()), samples

    def flat_mean_grad(self, samples: float) -> torch.Tensor:
        """The accumulated gradient divided by ``samples``, flattened into the reused gradient buffer."""
        offset = 0
        for p in self.params:
            part = self._gradient[offset : offset + p.numel()]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1)).div_(samples)
            offset += p.numel()
        return self._gradient

    def apply(self, flat: torch.Tensor) -> str | None:
        """One optimizer step with ``flat`` (a gradient laid out as flat_mean_grad's) as the gradient; None
        if applied, else why it was not. A step that would leave a parameter or optimizer slot NaN/Inf is
        undone: a peer with non-finite weights trains on them forever and shares them with every joiner."""
        if not torch.isfinite(flat).all():
            self.drop_gradients()
            return "the averaged gradient holds NaN/Inf"
        offset = 0
        for p in self.params:
            self._before_step[offset : offset + p.numel()] = p.data.reshape(-1)
            # a view, not a copy: zero_grad(set_to_none) below drops it before the buffer is reused
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        slots = {id(p): {k: v.clone() for k, v in self.optimizer.state.get(p, {}).items()
                         if isinstance(v, torch.Tensor)} for p in self.params} if self._slots_at_risk(flat) else None
        self.optimizer.step()
        self.drop_gradients()
        if all(bool(torch.isfinite(t).all()) for t in self.state_tensors()):
            return None
        offset = 0
        for p in self.params:
            p.data.copy_(self._before_step[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for p in self.params:
            saved = slots.get(id(p)) if slots is not None else None
            if saved:
                self.optimizer.state[p] = saved
            else:  # no slots yet, or not copied (not at risk): they restart from nothing
                self.optimizer.state.pop(p, None)
        return "the step would have made parameters or optimizer state non-finite; undone"

    @staticmethod
    def _slots_at_risk(flat: torch.Tensor) -> bool:
        """Whether squares of this gradient could overflow Adam's second moment (float32 max is 3.4e38), the
        one way a finite gradient reaches the optimizer's slots as Inf; only then are the slots copied."""
        return bool(flat.abs().max() > 1e18) if flat.numel() else False

    def drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forget_residuals(self) -> None:
        """After loading another peer's state, what our codec dropped from earlier rounds no longer applies."""
        for carried in (self.residual, self.average_residual):
            if carried is not None:
                carried.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, then the optimizer's per-parameter slots: what state averaging averages."""
        tensors = [p.data for p in self.params]
        for p in self.params:
            slot = self.optimizer.state.get(p, {})
            tensors += [slot[k] for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if k in slot]
        return tensors

    def flat_state(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.state_tensors()])

    def load_flat_state(self, flat: torch.Tensor) -> None:
        """Copies ``flat`` (laid out as flat_state's) back into the parameters and optimizer slots."""
        offset = 0
        for t in self.state_tensors():
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
