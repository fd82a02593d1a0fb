"""This peer's side of the model: its device, its optimizer, the flat buffers the all-reduce reads and writes,
the error-feedback residuals, the optimizer step, and the model's state as named tensors. No networking and no
timing: the trainer decides when each of these runs (all of them in worker threads, never on the event loop)."""

from __future__ import annotations

import math

import torch

from peerd.config import TrainingConfig
from peerd.errors import ConfigError
from peerd.tasks import Batch, Task, to_device
from peerd.training.device import autocast, flat_views, host_buffer, resolve_device, zeros_on_touch
from peerd.wire.codec import all_finite

# Slots the optimizers peerd builds keep per parameter; state averaging averages the float ones.
AVERAGED_SLOTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
# A gradient element beyond this could overflow Adam's second moment with its square (float32 max is 3.4e38),
# the one way a finite gradient reaches the optimizer's slots as Inf: only then are the slots copied before a step.
SLOTS_AT_RISK = 1e18
Template = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _abs_peak(tensors: list[torch.Tensor]) -> float:
    """The largest |element| of ``tensors`` in one pass over them: NaN if one holds NaN, Inf if one holds Inf."""
    present = [t for t in tensors if t.numel()]
    if not present:
        return 0.0
    return float(torch.stack([torch.linalg.vector_norm(t, ord=math.inf).float() for t in present]).max())


def make_optimizer(config: TrainingConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)


def init_slots(optimizer: torch.optim.Optimizer) -> None:
    """Creates the per-parameter slots torch would create at the first step, with the values it would give
    them, so a peer's state has the same tensors (names, layout) before its first step as after it: a joiner
    at step 0 and a donor at step 500 describe their states alike."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state.setdefault("step", torch.tensor(0.0))
                state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                state.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
            elif isinstance(optimizer, torch.optim.SGD) and group["momentum"]:
                # torch starts the buffer as the first gradient: momentum * 0 + grad is the same thing
                state.setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


class LocalModel:
    def __init__(self, config: TrainingConfig, task: Task, error_feedback: bool) -> None:
        """``error_feedback``: keep the residuals the all-reduce carries from one round into the next."""
        self.task = task
        self.device = resolve_device(config.device)
        self.precision = config.precision
        if self.device.type != "cpu":
            from peerd.experts.client import RemoteMoE  # only models with remote experts need it

            if any(isinstance(m, RemoteMoE) for m in task.model.modules()):
                raise ConfigError(
                    f"training.device is {config.device!r}, but this model has remote mixture-of-experts layers, "
                    "whose expert calls take CPU tensors: set training.device: cpu for it",
                    field="training.device",
                )
        self.model = task.model.to(self.device)
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        # Frozen weights (a LoRA run's base model) are loaded alike by every peer and never change: they are
        # neither averaged nor part of the state that joiners download and checkpoints hold.
        self.frozen = {name for name, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        self.total_numel = sum(p.numel() for p in self.model.parameters())
        self.optimizer = make_optimizer(config, self.model)
        init_slots(self.optimizer)
        self.numel = sum(p.numel() for p in self.params)
        self.residual = torch.zeros(self.numel) if error_feedback else None
        # what this peer's reductions dropped of their averages: only the span it reduces, and nothing under
        # top-k (whose members carry what the average leaves out), so its pages stay unmapped until written
        self.average_residual = zeros_on_touch(self.numel) if error_feedback else None
        # Reused every step: a fresh model-sized tensor per step would pay a page fault per 4 KiB each time.
        self._gradient = host_buffer(self.numel, self.device)
        self.averaged = host_buffer(self.numel, self.device)  # the all-reduce's `out`
        self._on_device = torch.empty(self.numel, device=self.device) if self.device.type != "cpu" else None
        self._before_step = torch.empty(self.numel, device=self.device)  # parameters before a step, to undo it

    # --- computing ------------------------------------------------------------------------------------------

    def forward_backward(self, batch: Batch) -> tuple[float, int]:
        samples = self.task.samples_in(batch)
        with autocast(self.device, self.precision):
            loss = self.task.loss(self.model, to_device(batch, self.device))
        # Gradients accumulate as sums over samples; flat_mean_grad and inner_step divide by the sample count.
        torch.autograd.backward(loss * samples)
        return float(loss.detach()), samples

    def validation_loss(self) -> float:
        with autocast(self.device, self.precision):
            return self.task.validation_loss(self.model)

    def flat_mean_grad(self, samples: float) -> torch.Tensor:
        """The accumulated gradient divided by ``samples``, flattened into the reused (CPU) gradient buffer."""
        for p, part in flat_views(self.params, self._gradient):
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad).div_(samples)
        return self._gradient

    def apply(self, flat: torch.Tensor) -> str | None:
        """One optimizer step with ``flat`` (a CPU gradient laid out as flat_mean_grad's) as the gradient; None
        if applied, else why it was not."""
        peak = _abs_peak([flat])
        if not math.isfinite(peak):
            self.drop_gradients()
            return "the averaged gradient holds NaN/Inf"
        gradient = self.to_device(flat)
        for p, part in flat_views(self.params, gradient):
            # a view, not a copy: zero_grad(set_to_none) drops it before the buffer is reused
            p.grad = part
        return self._guarded_step(peak > SLOTS_AT_RISK)

    def inner_step(self, samples: int) -> str | None:
        """diloco: one local optimizer step with the gradient accumulated over ``samples`` samples."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, float(samples))
        peak = _abs_peak(grads)
        if not math.isfinite(peak):
            self.drop_gradients()
            return "the local gradient holds NaN/Inf"
        return self._guarded_step(peak > SLOTS_AT_RISK)

    def _guarded_step(self, slots_at_risk: bool) -> str | None:
        """Steps the optimizer with the gradients in place. A step that would leave a parameter or optimizer
        slot NaN/Inf is undone: a peer with non-finite weights trains on them forever and shares them."""
        for p, saved in flat_views(self.params, self._before_step):
            saved.copy_(p.data)
        slots = {id(p): {k: v.clone() for k, v in self.optimizer.state.get(p, {}).items()
                         if isinstance(v, torch.Tensor)} for p in self.params} if slots_at_risk else None
        self.optimizer.step()
        self.drop_gradients()
        if all_finite(self.state_tensors()):
            return None
        for p, saved in flat_views(self.params, self._before_step):
            p.data.copy_(saved)
        for p in self.params:
            saved_slots = slots.get(id(p)) if slots is not None else None
            if saved_slots:
                self.optimizer.state[p] = saved_slots
            else:  # not copied (not at risk): they restart from nothing
                self.optimizer.state.pop(p, None)
        init_slots(self.optimizer)
        return "the step would have made parameters or optimizer state non-finite; undone"

    def to_device(self, flat: torch.Tensor) -> torch.Tensor:
        """A CPU flat tensor on the model's device, through one reused device buffer (or itself on the CPU)."""
        if self._on_device is None:
            return flat
        return self._on_device.copy_(flat, non_blocking=flat.is_pinned())

    def drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forget_residuals(self) -> None:
        """After loading another peer's state, what our codec dropped from earlier rounds no longer applies."""
        if self.residual is not None:
            self.residual.zero_()
        if self.average_residual is not None:  # fresh zero pages: zero_() would map every one of them
            self.average_residual = zeros_on_touch(self.numel)

    # --- state ------------------------------------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, then the optimizer's float per-parameter slots: what state averaging averages."""
        tensors = [p.data for p in self.params]
        for p in self.params:
            slot = self.optimizer.state.get(p, {})
            tensors += [slot[k] for k in AVERAGED_SLOTS if k in slot]
        return tensors

    def flat_state(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.state_tensors()]).cpu()

    def load_flat_state(self, flat: torch.Tensor) -> None:
        """Copies ``flat`` (laid out as flat_state's) back into the parameters and optimizer slots."""
        for t, part in flat_views(self.state_tensors(), flat):
            t.copy_(part)

    def named_state(self) -> dict[str, torch.Tensor]:
        """The live tensors a training state holds, by stable name: ``model/<state_dict key>`` (frozen weights
        left out) and ``inner/<parameter index>/<slot>`` (the same on every peer with the same fingerprint)."""
        tensors = {"model/" + name: t for name, t in self.model.state_dict().items() if name not in self.frozen}
        for i, p in enumerate(self.params):
            for slot, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"inner/{i}/{slot}"] = value
        return tensors

    def template(self) -> Template:
        return {name: (tuple(t.shape), t.dtype) for name, t in self.named_state().items()}

    def export_state(self, parameters: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """CPU copies of :meth:`named_state`; ``parameters`` (flat, laid out as the parameters) replaces the
        model's own parameter values (diloco serves its shared parameters, not its mid-phase ones)."""
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.named_state().items()}
        if parameters is not None:
            for name, (_, part) in zip(self.param_names, flat_views(self.params, parameters), strict=True):
                tensors["model/" + name] = part.detach().to("cpu", copy=True).contiguous()
        return tensors

    def import_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies a state already checked against :meth:`template` into the live tensors."""
        with torch.no_grad():
            for name, live in self.named_state().items():
                live.copy_(tensors[name])
