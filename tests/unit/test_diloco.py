"""DiLoCo's local pieces: the outer step and its fold, eager optimizer slots, devices and bf16, named state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peerd.averaging.verify.payloads import code_average
from peerd.config import CodecConfig, TaskConfig, TrainingConfig
from peerd.config.diloco import DilocoConfig
from peerd.errors import ConfigError
from peerd.tasks import build_task
from peerd.training.device import resolve_device, zeros_on_touch
from peerd.training.diloco.outer import MOMENTUM, SHARED, OuterState
from peerd.training.local import LocalModel, init_slots

pytestmark = pytest.mark.timeout(60)


def local_model(**training: object) -> LocalModel:
    task = build_task(TaskConfig(name="synthetic", options={"dim": 8, "out_dim": 2}), shard_index=0)
    return LocalModel(TrainingConfig(mode="diloco", lr=0.05, **training), task, error_feedback=True)


def flat_params(local: LocalModel) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in local.params])


def inner_steps(local: LocalModel, n: int) -> None:
    batches = local.task.train_batches()
    for _ in range(n):
        _, samples = local.forward_backward(next(batches))
        assert local.inner_step(samples) is None


def test_diloco_defaults_to_adamw_inner_steps_and_sync_keeps_adam() -> None:
    assert TrainingConfig(mode="diloco").optimizer == "adamw"
    assert TrainingConfig(mode="diloco", optimizer="sgd").optimizer == "sgd"
    assert TrainingConfig().optimizer == "adam"
    with pytest.raises(ValueError, match="phase_end: lockstep"):
        TrainingConfig(mode="diloco", samples_per_step=32)


def test_without_overlap_outer_sgd_with_lr_1_and_no_momentum_lands_on_the_local_parameters() -> None:
    local = local_model()
    outer = OuterState(DilocoConfig(outer_lr=1.0, outer_momentum=0.0), local)
    start = flat_params(local)
    inner_steps(local, 5)
    end = flat_params(local)
    assert not torch.equal(start, end)
    pseudo = outer.end_phase()
    assert torch.allclose(pseudo, start - end)
    assert outer.step(pseudo.clone()) is None  # alone: the average is our own
    assert torch.allclose(outer.shared, end, atol=1e-6)
    assert torch.allclose(flat_params(local), end, atol=1e-6)


def test_nesterov_outer_step_moves_shared_parameters_by_lr_times_one_plus_momentum_at_first() -> None:
    local = local_model()
    outer = OuterState(DilocoConfig(outer_lr=0.7, outer_momentum=0.9), local)
    theta = outer.shared.clone()
    inner_steps(local, 3)
    pseudo = outer.end_phase().clone()
    averaged = pseudo * 0.5  # e.g. the group's average
    assert outer.step(averaged) is None
    # torch's SGD starts the momentum buffer at the gradient; Nesterov then steps by g + m * buf
    assert torch.allclose(outer.shared, theta - 0.7 * 1.9 * averaged, atol=1e-6)
    assert torch.allclose(flat_params(local), outer.shared)  # without overlap the model becomes theta
    assert torch.allclose(outer.named()[MOMENTUM], averaged)


def test_overlap_keeps_the_progress_made_while_the_round_was_in_flight() -> None:
    local = local_model()
    outer = OuterState(DilocoConfig(outer_lr=0.7, outer_momentum=0.0), local)
    theta = outer.shared.clone()
    inner_steps(local, 3)
    pseudo = outer.end_phase().clone()  # the next phase starts from here, before the average lands
    x = flat_params(local)
    inner_steps(local, 2)
    progress = flat_params(local) - x
    averaged = pseudo * 0.8
    assert outer.step(averaged) is None
    expected_theta = theta - 0.7 * averaged
    assert torch.allclose(outer.shared, expected_theta, atol=1e-6)
    assert torch.allclose(flat_params(local), expected_theta + progress, atol=1e-5)
    assert torch.allclose(outer.anchor, expected_theta)  # the next pseudo-gradient is -progress
    assert torch.allclose(outer.end_phase(), -progress, atol=1e-5)


def test_a_non_finite_average_is_refused_and_changes_nothing() -> None:
    local = local_model()
    outer = OuterState(DilocoConfig(), local)
    inner_steps(local, 2)
    before, model = outer.shared.clone(), flat_params(local)
    bad = outer.end_phase().clone()
    bad[3] = float("nan")
    assert "NaN" in (outer.step(bad) or "")
    assert torch.equal(outer.shared, before) and torch.equal(flat_params(local), model)


def test_an_outer_step_prepared_beside_inner_steps_changes_nothing_until_committed_and_not_a_reloaded_state() -> None:
    local = local_model()
    outer = OuterState(DilocoConfig(outer_lr=0.7, outer_momentum=0.9), local)
    inner_steps(local, 3)
    averaged = outer.end_phase().clone() * 0.5
    twin = OuterState(DilocoConfig(outer_lr=0.7, outer_momentum=0.9), local_model())
    twin.adopt(outer.flat())
    twin.anchor.copy_(outer.anchor)
    shared, momentum = outer.shared.clone(), outer.named()[MOMENTUM].clone()
    update = outer.prepare(averaged)
    assert not isinstance(update, str)
    inner_steps(local, 2)  # the next phase goes on meanwhile
    assert torch.equal(outer.shared, shared) and torch.equal(outer.named()[MOMENTUM], momentum)
    model, anchor = flat_params(local), outer.anchor.clone()
    assert outer.commit(update)
    assert twin.step(averaged) is None  # the same step taken at once, under the lock
    assert torch.equal(outer.shared, twin.shared) and torch.equal(outer.named()[MOMENTUM], twin.named()[MOMENTUM])
    assert torch.allclose(flat_params(local), model + (outer.shared - anchor), atol=1e-6)  # progress kept
    # a state loaded between prepare and commit (a joiner's sync): the update is stale and is not applied
    stale = outer.prepare(averaged)
    assert not isinstance(stale, str)
    outer.adopt(twin.flat())
    assert not outer.commit(stale)
    assert torch.equal(outer.shared, twin.shared)


def test_inner_step_refuses_a_non_finite_gradient() -> None:
    local = local_model()
    before = flat_params(local)
    _, samples = local.forward_backward(next(local.task.train_batches()))
    local.params[0].grad[0] = float("inf")  # type: ignore[index]
    assert "NaN/Inf" in (local.inner_step(samples) or "")
    assert torch.equal(flat_params(local), before)


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_eager_optimizer_slots_give_the_same_steps_as_torchs_lazy_ones(kind: str) -> None:
    def run(eager: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        config = TrainingConfig(optimizer=kind, momentum=0.9 if kind == "sgd" else 0.0)
        from peerd.training.local import make_optimizer

        optimizer = make_optimizer(config, model)
        if eager:
            init_slots(optimizer)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            model(torch.randn(5, 6, generator=g)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert torch.equal(run(eager=True), run(eager=False))


def test_devices_that_are_not_there_are_refused_naming_the_field() -> None:
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        for name in ("cuda", "cuda:1"):
            with pytest.raises(ConfigError, match="training.device") as e:
                resolve_device(name)
            assert e.value.field == "training.device"
    if not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match="no MPS"):
            resolve_device("mps")


def mapped_mib(tensor: torch.Tensor) -> float:
    """MiB of ``tensor``'s pages present in memory, from /proc/self/pagemap (bit 63 of each page's entry)."""
    page = 4096
    first = tensor.data_ptr() // page
    last = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page / 2**20


def test_a_reducers_residual_takes_memory_only_for_the_span_written() -> None:
    residual = zeros_on_touch(64 * 2**20)  # 256 MiB of zeros
    assert mapped_mib(residual) < 1
    # a checked top-k reducer's average carries no residual of its own: its span of the residual stays unmapped
    average = torch.randn(8 * 2**20)
    payload = code_average(average, residual[: average.numel()], CodecConfig(scheme="topk"), True, "reducer")
    assert len(payload) < average.numel() // 16 and int((average != 0).sum()) >= average.numel() // 100
    assert mapped_mib(residual) < 1
    residual[: 16 * 2**20].add_(1.0)  # an 8-bit reducer's span of 4
    assert 64 <= mapped_mib(residual) < 66
    assert float(residual[16 * 2**20 :].abs().sum()) == 0.0
    local = local_model()
    assert local.average_residual is not None
    local.average_residual.add_(1.0)
    local.forget_residuals()
    assert float(local.average_residual.abs().sum()) == 0.0


def test_bf16_autocast_trains_on_cpu_and_keeps_fp32_weights() -> None:
    task = build_task(TaskConfig(name="lm", options={"d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 32,
                                                     "batch_size": 4, "max_files": 20, "val_files": 2,
                                                     "val_batches": 1}), shard_index=0)
    local = LocalModel(TrainingConfig(mode="diloco", precision="bf16", device="cpu"), task, error_feedback=False)
    batches = task.train_batches()
    first = None
    for _ in range(5):
        loss, samples = local.forward_backward(next(batches))
        first = first if first is not None else loss
        assert local.inner_step(samples) is None
    assert all(p.dtype == torch.float32 for p in local.params)
    assert local.validation_loss() < first + 0.5


def test_named_state_round_trips_and_joiners_get_the_shared_parameters() -> None:
    source, target = local_model(), local_model()
    outer = OuterState(DilocoConfig(), source)
    inner_steps(source, 3)
    assert set(source.template()) == set(target.template())  # slots exist before the first step too
    exported = source.export_state()
    target.import_state(exported)
    assert torch.equal(flat_params(target), flat_params(source))
    served = source.export_state(parameters=outer.shared)
    target.import_state(served)
    assert torch.equal(flat_params(target), outer.shared)
    assert {SHARED, MOMENTUM} == set(outer.named())


def test_accumulate_sums_micro_batches_into_one_inner_step_and_a_phase_end_keeps_the_rest() -> None:
    from types import SimpleNamespace

    from peerd.training.diloco import DilocoMode
    from peerd.training.report import TrainingReport

    def mode_of(local: LocalModel, accumulate: int) -> DilocoMode:
        config = TrainingConfig(mode="diloco", lr=0.05, diloco={"accumulate": accumulate})  # type: ignore[arg-type]
        host = SimpleNamespace(config=config, local=local, report=TrainingReport(fingerprint="x", parameters=1))
        return DilocoMode(host)  # type: ignore[arg-type]

    accumulating, whole = local_model(), local_model()
    mode = mode_of(accumulating, 2)
    batches = accumulating.task.train_batches()
    first, second = next(batches), next(batches)
    _, samples = accumulating.forward_backward(first)
    before = flat_params(accumulating)
    assert mode.after_backward(samples) is None and torch.equal(flat_params(accumulating), before)  # not yet
    _, samples = accumulating.forward_backward(second)
    assert mode.after_backward(samples) is None and mode.host.report.inner_steps == 1
    # the same step as one of the two micro-batches together
    _, both = whole.forward_backward((torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])))
    assert whole.inner_step(both) is None
    assert torch.allclose(flat_params(accumulating), flat_params(whole), atol=1e-6)
    _, samples = accumulating.forward_backward(next(batches))
    mode.after_backward(samples)
    moved = flat_params(accumulating)
    assert mode._inner_step() is None and not torch.equal(flat_params(accumulating), moved)  # what a phase end does
    assert mode.host.report.inner_steps == 2 and mode._accumulated == (0, 0)
