"""Property-based fuzzing of every decoder a peer's bytes reach, CI-sized (benchmarks/fuzz_decoders.py runs
>= 100,000 cases per decoder). Derandomized, so CI sees the same cases on every run."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from peerd.config import CodecConfig
from peerd.errors import CodecError, ProtocolViolation, StateError
from peerd.training.state import unpack_state
from peerd.wire import codec
from tests.unit import fuzz_targets
from tests.unit.fuzz_targets import TARGETS, Target

CI = settings(max_examples=60, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_decoder_returns_a_valid_value_or_a_documented_error(target: Target) -> None:
    @CI
    @given(target.inputs)
    def decode_one(value: Any) -> None:
        try:
            target.run(value)
        except target.errors:
            pass

    decode_one()


def _payload(*shape: int) -> bytearray:
    return codec.encode(torch.zeros(shape), CodecConfig(lossless=True))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("dims", [(0, 2**64 - 1), (0, 2**62, 4), (2**40, 0, 2**40)])
def test_codec_refuses_empty_shapes_whose_strides_overflow(dims: tuple[int, ...]) -> None:
    payload = _payload(*(0 if d == 0 else 1 for d in dims))
    struct.pack_into(f"<{len(dims)}Q", payload, codec.HEADER.size, *dims)
    with pytest.raises(CodecError, match="overflows"):
        codec.decode(bytes(payload), peer_id="peer")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("nested", [b"[" * 60000, b"[" * 5000 + b"]" * 5000])
def test_signed_record_with_a_deeply_nested_payload_is_refused(nested: bytes) -> None:
    value = {"p": nested, "k": b"k", "s": b"s", "t": b"", "e": 1.0}
    with pytest.raises(ProtocolViolation):
        fuzz_targets.VERIFIERS[0].open(fuzz_targets.KEY_ID, fuzz_targets.PID, value, 1.0)


@pytest.mark.timeout(10)
def test_codec_refuses_a_claimed_size_without_allocating_it() -> None:
    payload = _payload(4)
    struct.pack_into("<QQ", payload, codec.HEADER.size - 8, 2**40, 2**40)  # numel and shape: 4 TiB of fp32
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(bytes(payload), peer_id="peer")


def _saved(state: dict[str, Any]) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _valid_state() -> dict[str, Any]:
    import io

    loaded = torch.load(io.BytesIO(fuzz_targets.VALID_STATE), weights_only=True)
    assert isinstance(loaded, dict)
    return loaded


def _set(state: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = path.split("/")
    node: Any = state
    for key in parents:
        node = node[int(key) if isinstance(node, list) or key.isdigit() and int(key) in node else key]
    node[int(last) if isinstance(node, list) or last.isdigit() and int(last) in node else last] = value
    return state


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("path", "value"), [
    ("version", torch.ones(2)),  # a tensor where a number belongs: its == is elementwise, its truth raises
    ("fingerprint", torch.zeros(0)),
    ("step", True),
    ("optimizer/state", torch.ones(1).to_sparse()),
    ("optimizer/state", [1, 2]),
    ("optimizer/state/0", 5),
    ("optimizer/state/0/exp_avg", torch.ones(7)),  # not its parameter's shape: the next step would fail
    ("optimizer/param_groups", "x"),
    ("optimizer/param_groups/0/lr", "0.1"),
    ("optimizer/param_groups/0/betas", (0.9,)),
    ("model/0.weight", torch.ones(2, 3).to_sparse()),
])
def test_state_refuses_values_of_the_wrong_kind_and_leaves_the_model(path: str, value: Any) -> None:
    model, optimizer = fuzz_targets._state_model()
    before = [p.detach().clone() for p in model.parameters()]
    blob = _saved(_set(_valid_state(), path, value))
    with pytest.raises(StateError):
        unpack_state(blob, model, optimizer, fuzz_targets.FINGERPRINT, source="test")
    assert all(p.equal(b) for p, b in zip(model.parameters(), before, strict=True))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # the optimizer still works after the refusal
