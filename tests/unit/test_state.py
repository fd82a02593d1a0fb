"""Training states against a template, checkpoint files and the Checkpointer, and the transfer manifest's checks:
everything here reads state that came from a file or a peer, so every refusal must name the source and the
tensor."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from peerd.config import CheckpointConfig
from peerd.errors import ConfigError, ProtocolViolation, StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.checkpoint import Checkpointer, check_directory, load_state, save_state
from peerd.training.state import TrainingState, check_state, template_of
from peerd.training.transfer.manifest import (
    MAX_TENSORS,
    PROTOCOL_VERSION,
    check_against_template,
    check_manifest,
    chunks,
    encode_manifest,
    layout_digest,
    manifest_limit,
)

pytestmark = pytest.mark.timeout(60)

FP = "0123456789abcdef"


def sample_state(step: int = 7, seed: int = 0) -> TrainingState:
    """Names and kinds like the trainer's: weights, optimizer slots (a 0-dim step), flat outer state, a flag."""
    g = torch.Generator().manual_seed(seed)
    return TrainingState(step, {
        "model/0.weight": torch.randn(3, 4, generator=g),
        "model/0.bias": torch.randn(3, generator=g).bfloat16(),
        "model/counter": torch.tensor([5], dtype=torch.int64),
        "inner/0/exp_avg": torch.randn(3, 4, generator=g),
        "inner/0/step": torch.tensor(3.0),
        "outer/momentum": torch.randn(20, generator=g),
        "outer/mask": torch.tensor([True, False, True]),
        "outer/empty": torch.empty(0, 4, dtype=torch.float16),
    })


def same(a: TrainingState, b: TrainingState) -> bool:
    return (a.step == b.step and list(a.tensors) == list(b.tensors)
            and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors))


# --- check_state ----------------------------------------------------------------------------------------------


def test_a_state_fits_its_own_template() -> None:
    state = sample_state()
    check_state(state, template_of(state), "peer-x")
    reordered = TrainingState(state.step, dict(reversed(state.tensors.items())))
    check_state(reordered, template_of(state), "peer-x")  # order is the sender's; names decide


def replaced(name: str, tensor: torch.Tensor) -> TrainingState:
    state = sample_state()
    state.tensors[name] = tensor
    return state


@pytest.mark.parametrize(("state", "match"), [
    (replaced("model/0.weight", torch.randn(4, 3)), r"model/0.weight is torch.float32 \(4, 3\), expected .* \(3, 4\)"),
    (replaced("model/0.bias", torch.randn(3)), "model/0.bias is torch.float32"),
    (replaced("model/0.weight", torch.randn(3, 4).to_sparse()), "model/0.weight is not a dense"),
    (replaced("model/0.weight", torch.randn(4, 3).t()), "model/0.weight is not a dense, contiguous"),
    (replaced("outer/momentum", torch.full((20,), float("inf"))), "outer/momentum holds NaN or Inf"),
    (replaced("inner/0/step", torch.tensor(float("nan"))), "inner/0/step holds NaN"),
    (replaced("outer/mask", torch.tensor([2, 0, 1], dtype=torch.uint8).view(torch.bool)), "other than 0 and 1"),
    (replaced("extra/one", torch.zeros(1)), r"unexpected \['extra/one'\]"),
    (TrainingState(7, {}), r"missing \['model/0.weight', .*, \.\.\.\] \(8\)"),
    (TrainingState(True, sample_state().tensors), "invalid step True"),
    (TrainingState(-1, sample_state().tensors), "invalid step -1"),
])
def test_check_state_names_the_source_and_the_tensor(state: TrainingState, match: str) -> None:
    with pytest.raises(StateError, match=match) as refused:
        check_state(state, template_of(sample_state()), "peer-x")
    assert str(refused.value).startswith("peer-x: ") and refused.value.source == "peer-x"


# --- checkpoint files -----------------------------------------------------------------------------------------


def test_a_state_file_round_trips_atomically(tmp_path: Path) -> None:
    state = sample_state()
    path = tmp_path / "state.pt"
    save_state(path, state, FP)
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]
    assert same(load_state(path, template_of(state), FP), state)


def damaged(tmp_path: Path, how: str) -> Path:
    path = tmp_path / "state.pt"
    state = sample_state()
    if how == "version 1":  # what an older peerd wrote: a model's and an optimizer's state dicts
        model = torch.nn.Linear(2, 2)
        torch.save({"format": "peerd.training-state", "version": 1, "fingerprint": FP, "step": 3,
                    "model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters()).state_dict()},
                   path)
        return path
    if how in ("nan", "shape"):
        state.tensors["outer/momentum"] = torch.full((20,), float("nan")) if how == "nan" else torch.zeros(21)
    save_state(path, state, "ffffffffffffffff" if how == "fingerprint" else FP)
    data = path.read_bytes()
    if how in ("truncated", "garbage", "empty"):
        path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\0" * 100, "empty": b""}[how])
    for key, value in {"format": ("format", "x"), "version 3": ("version", 3), "tensors": ("tensors", [1]),
                       "step": ("step", "7")}.items():
        if how == key:
            loaded = torch.load(path, weights_only=True)
            loaded[value[0]] = value[1]
            torch.save(loaded, path)
    return path


@pytest.mark.parametrize(("how", "match"), [
    ("truncated", "not a readable peerd state"), ("garbage", "not a readable"), ("empty", "not a readable"),
    ("version 1", r"a version-1 checkpoint .* reads version 2 only"), ("version 3", "state format version 3"),
    ("format", "not a peerd training state"), ("fingerprint", "another model/config"), ("tensors", "no tensors"),
    ("step", "invalid step '7'"), ("nan", "outer/momentum holds NaN"), ("shape", r"outer/momentum is .* \(21,\)"),
])
def test_unusable_state_files_are_refused_naming_the_path(tmp_path: Path, how: str, match: str) -> None:
    path = damaged(tmp_path, how)
    with pytest.raises(StateError, match=match) as refused:
        load_state(path, template_of(sample_state()), FP)
    assert str(refused.value).startswith(f"{path}: ")


def test_checkpoints_are_pruned_and_resume_falls_back_past_a_truncated_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpointer = Checkpointer(CheckpointConfig(directory=tmp_path, keep=2), tmp_path)
    for step in (10, 20, 30):
        checkpointer.save(sample_state(step, seed=step), FP)
    assert [p.name for p in checkpointer.files()] == ["ckpt-000000030.pt", "ckpt-000000020.pt"]
    assert not list(tmp_path.glob("*.partial"))

    newest = checkpointer.files()[0]
    newest.write_bytes(newest.read_bytes()[:100])  # e.g. the disk filled up while copying it elsewhere
    with caplog.at_level(logging.ERROR):
        resumed = checkpointer.resume(template_of(sample_state()), FP)
    assert resumed is not None and same(resumed, sample_state(20, seed=20))
    assert "ckpt-000000030.pt" in caplog.text


def test_resume_without_checkpoints_and_with_only_bad_ones(tmp_path: Path) -> None:
    checkpointer = Checkpointer(CheckpointConfig(directory=tmp_path), tmp_path)
    assert checkpointer.resume(template_of(sample_state()), FP) is None
    (tmp_path / "ckpt-000000001.pt").write_bytes(b"not a checkpoint")
    damaged(tmp_path, "version 1").rename(tmp_path / "ckpt-000000002.pt")
    with pytest.raises(StateError, match="no usable checkpoint") as refused:
        checkpointer.resume(template_of(sample_state()), FP)
    assert "ckpt-000000002.pt: a version-1 checkpoint" in str(refused.value)
    assert "ckpt-000000001.pt: not a readable" in str(refused.value)


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_naming_it(tmp_path: Path) -> None:
    fresh = tmp_path / "new" / "ckpt"
    check_directory(fresh)
    assert fresh.is_dir() and not list(fresh.iterdir())  # created, and the probe left nothing behind

    (tmp_path / "a-file").write_text("")
    # tests run as root, where a read-only mode stops nothing; a directory under a regular file cannot exist
    blocked = tmp_path / "a-file" / "ckpt"
    with pytest.raises(ConfigError) as refused:
        check_directory(blocked)
    assert str(refused.value) == f"training.checkpoint.directory {blocked} is not writable: Not a directory (ENOTDIR)"
    assert refused.value.context["field"] == "training.checkpoint.directory"


def test_a_checkpoint_that_fails_on_a_full_disk_is_logged_and_the_last_good_one_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpointer = Checkpointer(CheckpointConfig(directory=tmp_path, keep=1), tmp_path)
    good = checkpointer.save(sample_state(10, seed=10), FP)
    assert good is not None
    # the next write goes to the kernel's always-full device: a real ENOSPC from torch.save's own writes
    failing = tmp_path / "ckpt-000000020.pt"
    failing.with_name(f"{failing.name}.{os.getpid()}.partial").symlink_to("/dev/full")
    with caplog.at_level(logging.ERROR):
        assert checkpointer.save(sample_state(20, seed=20), FP) is None
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert f"to {failing} failed: No space left on device (ENOSPC)" in record.getMessage()
    assert f"newest good checkpoint: {good}" in record.getMessage()
    assert checkpointer.files() == [good]  # keep=1 pruned nothing: the failed one never counted
    assert not list(tmp_path.glob("*.partial"))
    resumed = checkpointer.resume(template_of(sample_state()), FP)
    assert resumed is not None and same(resumed, sample_state(10, seed=10))

    assert checkpointer.save(sample_state(30, seed=30), FP) == tmp_path / "ckpt-000000030.pt"  # space is back
    assert [p.name for p in checkpointer.files()] == ["ckpt-000000030.pt"]


# --- the transfer manifest ------------------------------------------------------------------------------------

PEER = "12D3KooWPeer"


def manifest(**changes: object) -> pb.StateResponse:
    response = encode_manifest(sample_state(), chunk_bytes=1 << 20)
    for key, value in changes.items():
        if key.startswith("t0_"):
            setattr(response.tensors[0], key[3:], value)
        else:
            setattr(response, key, value)
    return response


def test_a_manifest_of_our_own_state_passes_and_describes_it() -> None:
    state = sample_state()
    checked = check_manifest(manifest(), PEER, max_bytes=1 << 20)
    check_against_template(checked, template_of(state), PEER)
    assert checked.step == 7 and checked.layout == template_of(state) and checked.start == (0, 0)
    assert checked.total_bytes == state.nbytes and checked.digest == layout_digest(template_of(state))
    assert len(manifest().SerializeToString()) + 8 <= manifest_limit(template_of(state))


def with_tensors(*infos: pb.TensorInfo, **fields: object) -> pb.StateResponse:
    response = pb.StateResponse(code=pb.STATE_OK, protocol_version=PROTOCOL_VERSION, chunk_bytes=1 << 16, tensors=infos,
                                total_bytes=sum(t.nbytes for t in infos))
    for key, value in fields.items():
        setattr(response, key, value)
    return response


F32 = pb.DTYPE_FLOAT32


@pytest.mark.parametrize(("response", "match"), [
    (manifest(protocol_version=1), "protocol version 1"),
    (manifest(chunk_bytes=0), "chunk size 0"),
    (manifest(chunk_bytes=1 << 30), "chunk size"),
    (manifest(step=2**63), "step"),
    (manifest(total_bytes=5), "total of 5 bytes, but its tensors hold"),
    (manifest(t0_name="bad name"), "tensor name 'bad name'"),
    (manifest(t0_name="x" * 201), "tensor name"),
    (manifest(t0_name="model/0.bias"), "model/0.bias listed twice"),
    (manifest(t0_dtype=9), "dtype code 9"),
    (manifest(t0_nbytes=47), r"model/0.weight of torch.float32 \(3, 4\) announces 47 bytes, not 48"),
    (manifest(start_tensor=8), "starting at tensor 8"),
    (manifest(start_tensor=1, start_offset=6), "starting at tensor 1, offset 6"),  # bias holds 6 bytes
    (with_tensors(), "0 tensors"),
    (with_tensors(*[pb.TensorInfo(name=f"t{i}", dtype=F32) for i in range(MAX_TENSORS + 1)]), "16385 tensors"),
    (with_tensors(pb.TensorInfo(name="t", dtype=F32, shape=[1] * 9, nbytes=4)), "9 dims"),
    # a product that wraps around 2**64 must not pass for a small tensor
    (with_tensors(pb.TensorInfo(name="t", dtype=pb.DTYPE_UINT8, shape=[2**32, 2**32 + 1], nbytes=2**32)),
     "announces 4294967296 bytes"),
])
def test_inconsistent_manifests_are_protocol_violations_naming_the_peer(response: pb.StateResponse,
                                                                        match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match) as refused:
        check_manifest(response, PEER, max_bytes=1 << 40)
    assert str(refused.value).startswith(f"{PEER} sent an invalid state manifest") and refused.value.peer_id == PEER


@pytest.mark.parametrize("response", [
    manifest(),  # announced total above the limit
    with_tensors(pb.TensorInfo(name="a", dtype=F32, shape=[64], nbytes=256), total_bytes=0),  # tensors above it
])
def test_a_state_above_max_bytes_is_refused_before_any_payload(response: pb.StateResponse) -> None:
    with pytest.raises(StateError, match=r"above training.max_state_bytes \(100\)|more than 100 bytes"):
        check_manifest(response, PEER, max_bytes=100)


@pytest.mark.parametrize(("name", "tensor", "match"), [
    ("model/0.weight", torch.zeros(4, 3), r"offers tensor model/0.weight as torch.float32 \(4, 3\), this peer has"),
    ("model/0.bias", torch.zeros(3), "model/0.bias as torch.float32"),
    ("model/new", torch.zeros(1), "tensor model/new, which this peer does not have"),
    ("outer/momentum", None, "without tensor outer/momentum"),
])
def test_a_manifest_of_another_layout_is_refused_naming_the_tensor(name: str, tensor: torch.Tensor | None,
                                                                   match: str) -> None:
    state = sample_state()
    if tensor is None:
        del state.tensors[name]
    else:
        state.tensors[name] = tensor
    checked = check_manifest(encode_manifest(state, 1 << 20), PEER, max_bytes=1 << 20)
    with pytest.raises(StateError, match=match) as refused:
        check_against_template(checked, template_of(sample_state()), PEER)
    assert str(refused.value).startswith(PEER)


def test_our_own_unsendable_state_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_manifest(TrainingState(1, {"x": torch.zeros(2, dtype=torch.float64)}), 1 << 20)
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_manifest(TrainingState(1, {"a b": torch.zeros(2)}), 1 << 20)
    with pytest.raises(ValueError, match="contiguous"):
        encode_manifest(TrainingState(1, {"x": torch.zeros(2, 3).t()}), 1 << 20)


def test_chunks_cut_each_tensor_and_resume_mid_tensor() -> None:
    sizes = (10, 0, 3, 25)
    assert list(chunks(sizes, (0, 0), 8)) == [(0, 0, 8), (0, 8, 2), (2, 0, 3), (3, 0, 8), (3, 8, 8), (3, 16, 8),
                                              (3, 24, 1)]
    assert list(chunks(sizes, (3, 13), 8)) == [(3, 13, 8), (3, 21, 4)]


def test_the_layout_digest_covers_order_shape_and_dtype() -> None:
    template = template_of(sample_state())
    digests = {layout_digest(template), layout_digest(dict(reversed(template.items()))),
               layout_digest({**template, "outer/momentum": ((21,), torch.float32)}),
               layout_digest({**template, "outer/momentum": ((20,), torch.float16)})}
    assert len(digests) == 4
