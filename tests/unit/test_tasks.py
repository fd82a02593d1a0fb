"""Tests of the training workloads (peerd.tasks): determinism, sharding, convergence and config errors."""

from __future__ import annotations

import math
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.config import TaskConfig
from peerd.errors import ConfigError
from peerd.tasks import Task, build_task, derive_seed, shard_for_peer
from peerd.tasks.lm import LMTask, stdlib_sources
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(60)

LN_256 = math.log(256)
SMALL_LM = {"seq_len": 32, "batch_size": 4, "d_model": 32, "d_ff": 64, "max_files": 40, "val_files": 4}
CUSTOM_MODULE = "peerd_test_custom_tasks"
BROKEN_MODULE = "peerd_test_broken_tasks"



def build(name: str, options: dict[str, Any] | None = None, shard: int = 0, **config: Any) -> Task:
    return build_task(TaskConfig(name=name, options=options or {}, **config), shard)


def same_batch(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize(("name", "options"), [("synthetic", {}), ("lm", SMALL_LM)])
def test_same_config_gives_same_model_and_fingerprint_on_every_shard(
    name: str, options: dict[str, Any]
) -> None:
    rng_before = torch.random.get_rng_state()
    a, b = build(name, options, shard=0), build(name, options, shard=1)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume torch's RNG"
    assert_same_params(a.model, b.model)
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 16 and int(a.fingerprint, 16) >= 0


def test_fingerprint_covers_options_after_defaults_seed_and_task() -> None:
    base = build("synthetic").fingerprint
    assert build("synthetic", {"dim": 32, "noise": 0.01}).fingerprint == base  # spelled-out defaults
    assert build("synthetic", num_shards=3, shard=2).fingerprint == base
    assert build("synthetic", {"dim": 16}).fingerprint != base
    assert build("synthetic", {"noise": 0.1}).fingerprint != base
    assert build("synthetic", seed=1).fingerprint != base
    assert build("lm", SMALL_LM).fingerprint != build("lm", {**SMALL_LM, "n_layers": 1}).fingerprint
    assert build("lm", SMALL_LM).fingerprint != build("lm", SMALL_LM, seed=1).fingerprint


def test_different_seeds_give_different_models() -> None:
    a, b = build("synthetic"), build("synthetic", seed=1)
    assert not torch.equal(a.model.state_dict()["weight"], b.model.state_dict()["weight"])


@pytest.mark.parametrize(("name", "options"), [("synthetic", {}), ("lm", SMALL_LM)])
def test_shards_differ_in_training_data_but_share_validation(name: str, options: dict[str, Any]) -> None:
    a, a_again, b = (build(name, options, shard=shard) for shard in (0, 0, 1))
    first_a = next(a.train_batches())
    assert same_batch(first_a, next(a_again.train_batches())), "a shard's stream must be reproducible"
    assert not same_batch(first_a, next(b.train_batches()))
    stream = a.train_batches()
    assert not same_batch(next(stream), next(stream)), "successive batches must differ"
    assert len(a.validation_batches()) > 0
    for va, vb in zip(a.validation_batches(), b.validation_batches(), strict=True):
        assert same_batch(va, vb)
    assert a.validation_loss(a.model) == b.validation_loss(b.model)


def test_synthetic_optimum_matches_state_dict_and_is_reached_by_local_sgd() -> None:
    task = build("synthetic", shard=5)
    assert task.optimum is not None
    state = task.model.state_dict()
    assert task.optimum.keys() == state.keys()
    assert all(task.optimum[k].shape == state[k].shape for k in state)
    start_error = max(float((state[k] - task.optimum[k]).abs().max()) for k in state)
    assert start_error > 0.1, "the initial model must not already be the teacher"

    optimizer = torch.optim.SGD(task.model.parameters(), lr=0.1)
    batches = task.train_batches()
    for _ in range(200):
        optimizer.zero_grad()
        task.loss(task.model, next(batches)).backward()
        optimizer.step()
    state = task.model.state_dict()
    assert max(float((state[k] - task.optimum[k]).abs().max()) for k in state) < 1e-2
    # At the optimum only the label noise (std 0.01) remains.
    assert task.validation_loss(task.model) < 1e-3


def test_validation_loss_restores_the_mode_and_needs_no_grad() -> None:
    task = build("lm", SMALL_LM)
    task.model.train()
    task.validation_loss(task.model)
    assert task.model.training
    task.model.eval()
    task.validation_loss(task.model)
    assert not task.model.training
    assert all(p.grad is None for p in task.model.parameters())


def test_lm_batches_model_output_and_initial_loss() -> None:
    task = build("lm")  # the defaults, as a peer runs them
    assert isinstance(task, LMTask)
    seq_len, batch_size = task.options.seq_len, task.options.batch_size
    assert task.batch_size == batch_size
    inputs, targets = batch = next(task.train_batches())
    assert inputs.shape == targets.shape == (batch_size, seq_len)
    assert inputs.dtype == targets.dtype == torch.int64
    assert 0 <= int(inputs.min()) and int(inputs.max()) < 256
    assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets are the inputs shifted by one byte"
    assert task.samples_in(batch) == batch_size
    assert task.model(inputs).shape == (batch_size, seq_len, 256)
    assert task.loss(task.model, batch).item() == pytest.approx(LN_256, abs=0.3)
    assert task.validation_loss(task.model) == pytest.approx(LN_256, abs=0.3)
    assert len(task.validation_batches()) == task.options.val_batches


def test_lm_loss_falls_with_local_adam() -> None:
    task = build("lm", shard=2)
    before = task.validation_loss(task.model)
    optimizer = torch.optim.Adam(task.model.parameters(), lr=3e-3)
    batches = task.train_batches()
    for _ in range(30):
        optimizer.zero_grad()
        task.loss(task.model, next(batches)).backward()
        optimizer.step()
    # Even unigram byte statistics alone take the loss from ln 256 (5.55) to about 3.3 nats/byte.
    assert task.validation_loss(task.model) < before - 1.5


def test_lm_shards_hold_disjoint_files_and_validation_is_held_out() -> None:
    files = stdlib_sources(SMALL_LM["max_files"])
    assert len(files) == SMALL_LM["max_files"]
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idlelib", "site-packages"}
    assert not any(skipped & set(f.relative_to(root).parts) for f in files)
    tasks = [build("lm", SMALL_LM, shard=s, num_shards=3) for s in range(3)]
    total = sum(int(t.train_data.numel()) for t in tasks) + int(tasks[0].val_data.numel())
    assert total == sum(f.stat().st_size for f in files)


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("synthetic", {"dimm": 3}, "training.task.options.dimm"),
        ("synthetic", {"dim": 0}, "training.task.options.dim"),
        ("lm", {"seq_len": 64, "layers": 4}, "training.task.options.layers"),
        ("lm", {"d_model": 30, "n_heads": 4}, "training.task.options"),
    ],
)
def test_bad_options_name_the_key(name: str, options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(name, options)
    assert info.value.field == field
    assert field in str(info.value)


def test_unknown_builtin_and_out_of_range_shard_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown task 'nosuch'") as info:
        build("nosuch")
    assert info.value.field == "training.task.name"
    with pytest.raises(ConfigError) as info:
        build("synthetic", shard=4, num_shards=4)
    assert info.value.field == "training.task.shard_index"
    with pytest.raises(ConfigError) as info:
        build("lm", SMALL_LM, shard=99, num_shards=100)
    assert info.value.field == "training.task.num_shards"


@pytest.fixture
def custom_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A module with the docs page's example task and misbehaving factories; one that fails to import."""
    page = (REPO / "docs" / "your-model.md").read_text()
    example = page.split("<!-- custom-task-example -->\n```python\n")[1].split("```")[0]
    (tmp_path / f"{CUSTOM_MODULE}.py").write_text(
        example
        + textwrap.dedent(
            """
            calls = []
            not_callable = 3

            def recording(options, seed, shard_index, num_shards):
                calls.append((options, seed, shard_index, num_shards))
                return line({}, seed, shard_index, num_shards)

            def not_a_task(options, seed, shard_index, num_shards):
                return torch.nn.Linear(1, 1)
            """
        )
    )
    (tmp_path / f"{BROKEN_MODULE}.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in (CUSTOM_MODULE, BROKEN_MODULE):
        sys.modules.pop(name, None)


@pytest.mark.usefixtures("custom_modules")
def test_custom_task_from_the_docs_example() -> None:
    task = build(f"{CUSTOM_MODULE}:line", seed=7, shard=1, num_shards=2)
    assert isinstance(task, Task) and task.fingerprint
    assert task.fingerprint == build(f"{CUSTOM_MODULE}:line", seed=7, shard=0, num_shards=2).fingerprint
    optimizer = torch.optim.SGD(task.model.parameters(), lr=0.1)
    batches = task.train_batches()
    before = task.validation_loss(task.model)
    for _ in range(20):
        optimizer.zero_grad()
        task.loss(task.model, next(batches)).backward()
        optimizer.step()
    assert task.validation_loss(task.model) < before

    build(f"{CUSTOM_MODULE}:recording", {"a": 1}, seed=3, shard=2, num_shards=5)
    assert sys.modules[CUSTOM_MODULE].calls == [({"a": 1}, 3, 2, 5)]
    with pytest.raises(ConfigError, match="unknown option 'x'") as info:
        build(f"{CUSTOM_MODULE}:line", {"x": 1})
    assert info.value.field == "training.task.options"


@pytest.mark.usefixtures("custom_modules")
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("peerd_no_such_module:make", "module 'peerd_no_such_module' not found"),
        ("peerd_no_such_package.tasks:make", "module 'peerd_no_such_package' not found"),
        (f"{BROKEN_MODULE}:make", "RuntimeError: boom at import"),
        (f"{CUSTOM_MODULE}:missing", "has no attribute 'missing'"),
        (f"{CUSTOM_MODULE}:not_callable", "non-callable attribute 'not_callable'"),
        (f"{CUSTOM_MODULE}:not_a_task", "returned Linear, not a peerd.tasks.Task"),
    ],
)
def test_bad_custom_task_names_are_config_errors(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build(name)
    assert info.value.field == "training.task.name"


def test_shard_for_peer_is_stable_in_range_and_overridable() -> None:
    config = TaskConfig(num_shards=16)
    peers = [f"12D3KooWPeer{i}" for i in range(200)]
    shards = [shard_for_peer(config, peer) for peer in peers]
    assert shards == [shard_for_peer(config, peer) for peer in peers]
    assert all(0 <= s < 16 for s in shards)
    assert set(shards) == set(range(16)), "200 peers should cover every one of 16 shards"
    # A fixed value: the mapping must not change between runs, machines or Python versions.
    assert shard_for_peer(TaskConfig(num_shards=1000), "12D3KooWTestPeer") == 58
    assert shard_for_peer(TaskConfig(num_shards=16, shard_index=3), "12D3KooWTestPeer") == 3


def test_derive_seed_is_stable_and_separates_purposes() -> None:
    assert derive_seed(0, "model") == derive_seed(0, "model")
    assert len({derive_seed(0, "model"), derive_seed(1, "model"), derive_seed(0, "shard", 0)}) == 3
    assert 0 <= derive_seed(2**70, "x") < 2**63
