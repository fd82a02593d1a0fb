"""Property-based fuzzing of every decoder a peer's bytes reach, CI-sized (benchmarks/fuzz_decoders.py runs
>= 100,000 cases per decoder). Derandomized, so CI sees the same cases on every run."""

from __future__ import annotations

import io
import struct
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import hashes
from hypothesis import HealthCheck, Phase, given, settings

from peerd.config import CodecConfig
from peerd.errors import CodecError, ProtocolViolation, StateError
from peerd.swarm import signing
from peerd.training.checkpoint import load_state
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
@pytest.mark.parametrize("nested", [b"[" * 30000, b"[" * 5000 + b"]" * 5000])
def test_signed_record_with_a_deeply_nested_payload_is_refused(nested: bytes) -> None:
    """A member's validly signed payload that nests too deeply for json (RecursionError) is refused."""
    signer = fuzz_targets.SIGNERS[0]
    message = signing._message(fuzz_targets.KEY_ID, signer.peer_id, nested, 1.0)
    value = {"p": nested, "k": signer.public_key, "s": signer._key.sign(message, signing.PSS, hashes.SHA256()),
             "t": b"", "e": 1.0}
    with pytest.raises(ProtocolViolation, match="not a sealed JSON object"):
        fuzz_targets.VERIFIERS[0].open(fuzz_targets.KEY_ID, signer.peer_id, value, 1.0)


@pytest.mark.timeout(10)
def test_codec_refuses_a_claimed_size_without_allocating_it() -> None:
    payload = _payload(4)
    struct.pack_into("<QQ", payload, codec.HEADER.size - 8, 2**40, 2**40)  # numel and shape: 4 TiB of fp32
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(bytes(payload), peer_id="peer")


def _saved(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("key", "value"), [
    ("version", torch.ones(2)),  # a tensor where a number belongs: its == is elementwise, its truth raises
    ("fingerprint", torch.zeros(0)),
    ("step", True),
    ("step", torch.tensor(7)),
    ("tensors", [torch.ones(1)]),
    ("tensors", torch.ones(1).to_sparse()),
    ("tensors/model/0.weight", torch.ones(3000).to_sparse()),
    ("tensors/model/0.weight", "weights"),
    ("tensors/outer/count", torch.tensor([3.0])),  # a float where the template has an int64
    ("tensors/inner/0/step", torch.ones(1)),  # 1 element, but not 0-dim
])
def test_a_state_file_with_values_of_the_wrong_kind_is_refused(key: str, value: Any) -> None:
    state = torch.load(io.BytesIO(fuzz_targets.VALID_STATE_FILE), weights_only=True)
    if key.startswith("tensors/"):
        state["tensors"][key.removeprefix("tensors/")] = value
    else:
        state[key] = value
    with pytest.raises(StateError, match="^test: "):
        load_state(io.BytesIO(_saved(state)), fuzz_targets.STATE_TEMPLATE, fuzz_targets.FINGERPRINT, source="test")
