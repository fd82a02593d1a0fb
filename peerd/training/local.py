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

    def apply(self, flat: torch.Tensor) -> None:
        """One optimizer step with ``flat`` (a gradient laid out as flat_mean_grad's) as the gradient."""
        offset = 0
        for p in self.params:
            # a view, not a copy: zero_grad(set_to_none) below drops it before the buffer is reused
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer.step()
        self.drop_gradients()

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
